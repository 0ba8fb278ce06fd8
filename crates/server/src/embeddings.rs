//! Embeddings: OpenAI `POST /v1/embeddings` (and Ollama's `/api/embed`, in
//! [`crate::ollama`]) over [`kapitsa_engine::embed::Embedder`]: the served model's final-norm
//! hidden states, pooled as the model declares (last token for Qwen3-Embedding-style models,
//! mean otherwise) and L2-normalised.
//!
//! - `input`: a string, an array of strings, an array of token ids, or an array of those
//!   (at most [`MAX_INPUTS`]); each is tokenized as the model's tokenizer does by default
//!   (special tokens it adds, e.g. a final `<|endoftext|>`, included).
//! - `encoding_format`: `float` (default) or `base64` (little-endian f32, as OpenAI).
//! - `dimensions`: keep the first N dimensions and normalise again (Matryoshka-trained models
//!   such as Qwen3-Embedding); 1..=the model's width.
//! - The embedder (its own f32 cache of up to 8192 positions, or the context if smaller) is
//!   made at the first request; inputs longer than that are a 400.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::{Api, ApiError, ApiResult};
use crate::params::{parse_body, token_ids, type_name, Fields};
use crate::{body_bytes, AppState};

/// Most inputs one request may embed.
pub const MAX_INPUTS: usize = 2048;
/// Most positions of the embedder's cache (the longest input).
pub const MAX_EMBED_TOKENS: usize = 8192;

/// The inputs of an embeddings request as token lists; `param` names the field.
pub fn inputs(st: &AppState, v: &Value, param: &str) -> ApiResult<Vec<Vec<u32>>> {
    let tok = &st.model.tokenizer;
    let text = |s: &str, p: &str| -> ApiResult<Vec<u32>> {
        if s.is_empty() {
            return Err(ApiError::bad_param(p, format!("'{p}' must not be empty")));
        }
        tok.encode(s, true, true)
            .map_err(|e| ApiError::bad_param(p, format!("cannot tokenize '{p}': {e}")))
    };
    let out = match v {
        Value::String(s) => vec![text(s, param)?],
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::bad_param(
                param,
                format!("'{param}' must not be empty"),
            ))
        }
        Value::Array(a) if a.iter().all(Value::is_number) => vec![token_ids(a, param)?],
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let p = format!("{param}[{i}]");
                match x {
                    Value::String(s) => text(s, &p),
                    Value::Array(t) if !t.is_empty() => token_ids(t, &p),
                    other => Err(ApiError::bad_param(
                        &p,
                        format!(
                            "'{p}' must be a string or a non-empty array of token ids, got {}",
                            type_name(other)
                        ),
                    )),
                }
            })
            .collect::<ApiResult<_>>()?,
        other => {
            return Err(ApiError::bad_param(
                param,
                format!(
                    "'{param}' must be a string, an array of strings or token ids, got {}",
                    type_name(other)
                ),
            ))
        }
    };
    if out.len() > MAX_INPUTS {
        return Err(ApiError::bad_param(
            param,
            format!("'{param}' may hold at most {MAX_INPUTS} inputs"),
        ));
    }
    Ok(out)
}

/// Embed `inputs` (off the async threads); vectors truncated to `dimensions` (renormalised).
pub async fn embed(
    st: &Arc<AppState>,
    inputs: Vec<Vec<u32>>,
    dimensions: Option<usize>,
    param: &str,
) -> ApiResult<Vec<Vec<f32>>> {
    let em =
        st.model.embed.as_ref().ok_or_else(|| {
            ApiError::bad("this server cannot compute embeddings with this model")
        })?;
    let e = em
        .get(st.engine.n_ctx().min(MAX_EMBED_TOKENS))
        .map_err(|e| ApiError::internal(format!("cannot make embeddings: {e}")))?;
    let param2 = param.to_string();
    let mut vecs = tokio::task::spawn_blocking(move || e.embed(&inputs))
        .await
        .map_err(|e| ApiError::internal(format!("embedding failed: {e}")))?
        .map_err(|e| match e {
            kapitsa_engine::EngineError::BadRequest(m) => ApiError::bad_param(&param2, m),
            other => ApiError::internal(format!("embedding failed: {other}")),
        })?;
    if let Some(k) = dimensions {
        let d = vecs.first().map_or(0, Vec::len);
        if k > d {
            return Err(ApiError::bad_param(
                "dimensions",
                format!("'dimensions' must be at most {d}, the model's embedding size"),
            ));
        }
        for v in &mut vecs {
            v.truncate(k);
            let n = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            if n > 0.0 {
                v.iter_mut().for_each(|x| *x = (f64::from(*x) / n) as f32);
            }
        }
    }
    Ok(vecs)
}

/// Standard base64 (with padding) of `bytes`.
pub fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        // `chunks` never yields an empty slice, so `c[0]` exists.
        let n = (u32::from(c[0]) << 16)
            | (u32::from(c.get(1).copied().unwrap_or(0)) << 8)
            | u32::from(c.get(2).copied().unwrap_or(0));
        for k in 0..4 {
            if k <= c.len() {
                out.push(ABC[((n >> (18 - 6 * k)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match embeddings_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response_for(Api::OpenAi),
    }
}

async fn embeddings_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let as_base64 = match f.str("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(f.error(
                "encoding_format",
                format!("unknown encoding_format '{other}' (expected 'float' or 'base64')"),
            ))
        }
    };
    let dimensions = f
        .int_in("dimensions", 1, i64::from(u32::MAX))?
        .map(|d| d as usize);
    let toks = inputs(&st, f.required("input")?, "input")?;
    st.check_open()?;
    let n_tokens: usize = toks.iter().map(Vec::len).sum();
    let vecs = embed(&st, toks, dimensions, "input").await?;
    let data: Vec<Value> = vecs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let e = if as_base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64(&bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": e})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": st.model.name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&1.0f32.to_le_bytes()), "AACAPw==");
    }
}
