//! API errors, rendered the way each API defines them.
//!
//! | class | status | OpenAI `error.type` (`code`) | Anthropic `error.type` |
//! |---|---|---|---|
//! | bad request (JSON, types, values, prompt too long, unsupported feature) | 400 | `invalid_request_error` | `invalid_request_error` |
//! | missing or wrong API key | 401 | `invalid_request_error` (`invalid_api_key`) | `authentication_error` |
//! | unknown model or route | 404 | `invalid_request_error` (`model_not_found` / `not_found`) | `not_found_error` |
//! | method not allowed on the route (with an `Allow` header) | 405 | `invalid_request_error` (`method_not_allowed`) | `invalid_request_error` |
//! | body larger than `--max-body-bytes` | 413 | `invalid_request_error` (`request_too_large`) | `request_too_large` |
//! | `Content-Type` present but not JSON | 415 | `invalid_request_error` (`unsupported_media_type`) | `invalid_request_error` |
//! | request queue full | 429 | `rate_limit_error` (`rate_limit_exceeded`) | `rate_limit_error` |
//! | engine failure | 500 | `server_error` | `api_error` |
//! | shutting down | 503 | `server_error` (`service_unavailable`) | `overloaded_error` |

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// Which API's error format to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
    /// Ollama's `{"error": "message"}`.
    Ollama,
}

/// The class of an error; decides the status code and the type names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400.
    InvalidRequest,
    /// 401.
    Authentication,
    /// 404.
    NotFound,
    /// 405.
    MethodNotAllowed,
    /// 413.
    TooLarge,
    /// 415.
    UnsupportedMediaType,
    /// 429.
    RateLimit,
    /// 500.
    Internal,
    /// 503.
    Unavailable,
}

impl ErrorKind {
    /// HTTP status of the class.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::RateLimit => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::Authentication
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::TooLarge
            | ErrorKind::UnsupportedMediaType => "invalid_request_error",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Internal | ErrorKind::Unavailable => "server_error",
        }
    }

    fn openai_code(self) -> Option<&'static str> {
        match self {
            ErrorKind::Authentication => Some("invalid_api_key"),
            ErrorKind::MethodNotAllowed => Some("method_not_allowed"),
            ErrorKind::TooLarge => Some("request_too_large"),
            ErrorKind::UnsupportedMediaType => Some("unsupported_media_type"),
            ErrorKind::RateLimit => Some("rate_limit_exceeded"),
            ErrorKind::Unavailable => Some("service_unavailable"),
            _ => None,
        }
    }

    fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::MethodNotAllowed
            | ErrorKind::UnsupportedMediaType => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Internal => "api_error",
            ErrorKind::Unavailable => "overloaded_error",
        }
    }
}

/// An error answer; rendered with [`ApiError::into_response_for`].
#[derive(Debug, Clone)]
pub struct ApiError {
    /// Class.
    pub kind: ErrorKind,
    /// Human-readable message.
    pub message: String,
    /// The request field at fault (OpenAI `param`).
    pub param: Option<String>,
    /// Machine-readable code (OpenAI `code`); defaults per class.
    pub code: Option<String>,
}

impl ApiError {
    /// An error of class `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::InvalidRequest, message)
    }

    /// 400 about the field `param`.
    pub fn bad_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::bad(message).with_param(param)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Internal, message)
    }

    /// Set the field at fault.
    pub fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_string());
        self
    }

    /// Set the machine-readable code.
    pub fn with_code(mut self, code: &str) -> ApiError {
        self.code = Some(code.to_string());
        self
    }

    /// The JSON body in `api`'s format.
    pub fn body(&self, api: Api) -> Value {
        match api {
            Api::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.kind.openai_type(),
                    "param": self.param,
                    "code": self.code.as_deref().or(self.kind.openai_code()),
                }
            }),
            Api::Anthropic => json!({
                "type": "error",
                "error": {"type": self.kind.anthropic_type(), "message": self.message},
            }),
            Api::Ollama => json!({"error": self.message}),
        }
    }

    /// The HTTP response in `api`'s format.
    pub fn into_response_for(self, api: Api) -> Response {
        let mut r = (self.kind.status(), axum::Json(self.body(api))).into_response();
        if self.kind == ErrorKind::Authentication && api == Api::OpenAi {
            r.headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({:?})", self.message, self.kind)
    }
}

/// Result of request handling.
pub type ApiResult<T> = Result<T, ApiError>;
