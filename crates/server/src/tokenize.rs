//! `POST /tokenize` and `POST /detokenize` (the shapes vLLM's server uses): turn text into the
//! served model's token ids and back, e.g. to build `/v1/completions` token prompts or
//! `logit_bias` maps.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::error::{Api, ApiError, ApiResult};
use crate::params::{parse_body, token_ids, Fields};
use crate::{body_bytes, AppState};

/// `POST /tokenize`: `{"prompt": TEXT, "add_special_tokens": bool (default true), "model":
/// optional}` -> `{"tokens": [ids], "count": n, "max_model_len": context size}`. Special
/// tokens written in the text are parsed, as in `/v1/completions`.
pub async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&st, body, |f| {
        let text = f
            .str("prompt")?
            .ok_or_else(|| ApiError::bad_param("prompt", "'prompt' is a required property"))?;
        let special = f.bool("add_special_tokens")?.unwrap_or(true);
        let ids = st
            .model
            .tokenizer
            .encode(text, special, true)
            .map_err(|e| ApiError::bad(format!("cannot tokenize the prompt: {e}")))?;
        Ok(json!({"tokens": ids, "count": ids.len(), "max_model_len": st.engine.n_ctx()}))
    })
}

/// `POST /detokenize`: `{"tokens": [ids], "model": optional}` -> `{"prompt": TEXT}` (special
/// tokens kept as text).
pub async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&st, body, |f| {
        let list = f
            .array("tokens")?
            .ok_or_else(|| ApiError::bad_param("tokens", "'tokens' is a required property"))?;
        let text = st
            .model
            .tokenizer
            .decode(&token_ids(list, "tokens")?, false)
            .map_err(|e| ApiError::bad_param("tokens", format!("bad token id in 'tokens': {e}")))?;
        Ok(json!({ "prompt": text }))
    })
}

/// Parse the body, check the optional `model`, and answer `make`'s JSON (or the error in
/// OpenAI's shape).
fn answer(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
    make: impl FnOnce(&Fields) -> ApiResult<Value>,
) -> Response {
    let r = (|| -> ApiResult<Value> {
        let body = body_bytes(st, body)?;
        let map: Map<String, Value> = parse_body(&body)?;
        let f = Fields::new(&map);
        if let Some(m) = f.str("model")? {
            st.check_model(Some(m))?;
        }
        make(&f)
    })();
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response_for(Api::OpenAi),
    }
}
