//! Ollama's API, for its many clients (Open WebUI, Continue's Ollama provider, ...):
//!
//! | method | path | notes |
//! |---|---|---|
//! | GET | `/api/version` | `{"version"}` |
//! | GET | `/api/tags`, `/api/ps` | the served model under its name and aliases |
//! | POST | `/api/show` | details, `model_info` (architecture, context length), `capabilities`, the chat template |
//! | POST | `/api/chat` | chat; NDJSON stream by default (`stream: false`: one object) |
//! | POST | `/api/generate` | `prompt` (+ `system`) through the chat template, verbatim with `raw`, fill-in-the-middle with `suffix`; NDJSON by default |
//! | POST | `/api/embed`, `/api/embeddings` | embeddings ([`crate::embeddings`]) |
//!
//! `options`: `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `num_predict` (-1 / -2: up to
//! the context), `stop`, `repeat_penalty`, `presence_penalty`, `frequency_penalty`; others
//! (`num_ctx`, `num_gpu`, ...) are ignored. `format`: `"json"` or a JSON schema (constrained
//! decoding). `think`: `true` / `false` / `"low" | "medium" | "high"` sets the template's
//! `enable_thinking` (and `reasoning_effort`); reasoning comes back in `message.thinking` /
//! `thinking`. Tools are OpenAI-style function tools; calls come back as
//! `message.tool_calls: [{"function": {"name", "arguments": {...}}}]`.
//!
//! Errors are Ollama's `{"error": "message"}` with the status of the error table.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kapitsa_engine::{Constraint, ReplyEvent, ReplyFormat, SamplingParams};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::engine::{FinishReason, Request};
use crate::error::{Api, ApiError, ApiResult};
use crate::gen::{random_u64, submit_all_for, Choice, Interrupted, Merged};
use crate::images::{self, content_value, Images, Piece};
use crate::params::{parse_body, type_name, Fields};
use crate::{body_bytes, embeddings, fim, response_format, AppState};

/// The Ollama version reported (clients gate features on it).
pub const VERSION: &str = "0.12.0";

fn fail(e: ApiError) -> Response {
    e.into_response_for(Api::Ollama)
}

/// RFC 3339 UTC time of `secs` since the UNIX epoch (`2026-12-02T10:00:00Z`).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

fn now() -> String {
    rfc3339(crate::gen::unix_now())
}

/// `GET /api/version`.
pub async fn version() -> Response {
    Json(json!({"version": VERSION})).into_response()
}

fn details(st: &AppState) -> Value {
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": st.model.arch,
        "families": [st.model.arch],
        "parameter_size": "",
        "quantization_level": "",
    })
}

fn listed(st: &AppState) -> Vec<Value> {
    st.model
        .names()
        .into_iter()
        .map(|n| {
            json!({
                "name": n,
                "model": n,
                "modified_at": rfc3339(st.model.created),
                "size": 0,
                "digest": format!("{:064x}", 0),
                "details": details(st),
            })
        })
        .collect()
}

/// `GET /api/tags`.
pub async fn tags(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"models": listed(&st)})).into_response()
}

/// `GET /api/ps`.
pub async fn ps(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"models": listed(&st)})).into_response()
}

/// `POST /api/show`.
pub async fn show(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| -> ApiResult<Response> {
        let body = body_bytes(&st, body)?;
        let map = parse_body(&body)?;
        let f = Fields::new(&map);
        let name = f.str("model")?.or(f.str("name")?);
        st.check_model(name)?;
        let arch = st.model.arch.clone();
        let mut caps = vec!["completion"];
        if st.model.template_uses_tools {
            caps.push("tools");
        }
        if st.model.reply_format.reasoning {
            caps.push("thinking");
        }
        if fim::FimFormat::of(&st.model.tokenizer).is_some() {
            caps.push("insert");
        }
        if st.model.embed.is_some() {
            caps.push("embedding");
        }
        let mut info = Map::new();
        info.insert("general.architecture".into(), arch.clone().into());
        info.insert(format!("{arch}.context_length"), st.engine.n_ctx().into());
        Ok(Json(json!({
            "modelfile": "",
            "parameters": "",
            "template": st.model.template_source.clone().unwrap_or_default(),
            "details": details(&st),
            "model_info": info,
            "capabilities": caps,
            "modified_at": rfc3339(st.model.created),
        }))
        .into_response())
    })();
    r.unwrap_or_else(fail)
}

/// Generation settings from `options` (and top-level `format`, `think`).
struct Opts {
    sampling: SamplingParams,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    format: Option<Constraint>,
    extra: Option<Value>,
    stream: bool,
}

fn opts(f: &Fields) -> ApiResult<Opts> {
    let mut s = SamplingParams::default();
    let mut max_tokens = None;
    let mut stop = Vec::new();
    if let Some(o) = f.object("options")? {
        let of = Fields::nested(o, "options.");
        crate::openai::sampling_fields(&of, "repeat_penalty", &mut s)?;
        s.seed = match of.i64("seed")? {
            Some(x) if x >= 0 => x as u64,
            _ => random_u64(),
        };
        max_tokens = match of.int_in("num_predict", -2, i64::from(u32::MAX))? {
            None | Some(-1 | -2) => None,
            Some(0) => Some(1),
            Some(n) => Some(n as usize),
        };
        stop = of.strings("stop", crate::openai::MAX_STOP)?;
    } else {
        s.seed = random_u64();
    }
    s.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let format = match f.get("format") {
        None => None,
        Some(Value::String(x)) if x == "json" => Some(Constraint::JsonObject),
        Some(Value::String(x)) if x.is_empty() => None,
        Some(Value::Object(o)) => Some(Constraint::JsonSchema(Value::Object(o.clone()))),
        Some(v) => {
            return Err(f.error(
                "format",
                format!(
                    "'format' must be \"json\" or a JSON schema object, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let extra = match f.get("think") {
        None => None,
        Some(Value::Bool(b)) => Some(json!({"enable_thinking": b})),
        Some(Value::String(e)) if ["low", "medium", "high"].contains(&e.as_str()) => {
            Some(json!({"enable_thinking": true, "reasoning_effort": e}))
        }
        Some(_) => {
            return Err(f.error(
                "think",
                "'think' must be true, false, \"low\", \"medium\" or \"high\"",
            ))
        }
    };
    Ok(Opts {
        sampling: s,
        max_tokens,
        stop,
        format,
        extra,
        stream: f.bool("stream")?.unwrap_or(true),
    })
}

/// Ollama chat messages -> chat-template messages; the `images` of user messages go to
/// `images` (the message's content becomes a list: its images, then its text).
fn messages(list: &[Value], images: &mut Images) -> ApiResult<Vec<Value>> {
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(o) = m else {
            return Err(ApiError::bad_param(&p, format!("'{p}' must be an object")));
        };
        let prefix = format!("{p}.");
        let mf = Fields::nested(o, &prefix);
        let role = mf
            .str("role")?
            .ok_or_else(|| mf.error("role", format!("'{p}.role' is a required property")))?;
        if !["system", "user", "assistant", "tool"].contains(&role) {
            return Err(mf.error(
                "role",
                format!("unknown role '{role}' (expected system, user, assistant or tool)"),
            ));
        }
        let text = mf.str("content")?.unwrap_or("");
        let mut content = Value::String(text.to_string());
        if let Some(list) = mf.array("images")?.filter(|a| !a.is_empty()) {
            if role != "user" {
                return Err(mf.error(
                    "images",
                    format!("'{p}.images': images are only accepted in user messages"),
                ));
            }
            let n = images::ollama_images(list, &format!("{p}.images"), images)?;
            let mut pieces = vec![Piece::Image; n];
            pieces.push(Piece::Text(text.to_string()));
            content = content_value(pieces);
        }
        let mut msg = json!({"role": role, "content": content});
        if let Some(t) = mf.str("thinking")? {
            msg["reasoning_content"] = t.into();
        }
        if let Some(n) = mf.str("tool_name")?.or(mf.str("name")?) {
            msg["name"] = n.into();
        }
        if let Some(calls) = mf.array("tool_calls")? {
            let mut conv = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let cp = format!("{p}.tool_calls[{j}]");
                let func = c
                    .get("function")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        ApiError::bad_param(&cp, format!("'{cp}.function' must be an object"))
                    })?;
                let name = func.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::bad_param(&cp, format!("'{cp}.function.name' must be a string"))
                })?;
                let args = func.get("arguments").cloned().unwrap_or_else(|| json!({}));
                conv.push(
                    json!({"type": "function", "function": {"name": name, "arguments": args}}),
                );
            }
            msg["tool_calls"] = Value::Array(conv);
        }
        out.push(msg);
    }
    Ok(out)
}

/// The NDJSON response fed by a task given the sending side.
fn ndjson<F, Fut>(f: F) -> Response
where
    F: FnOnce(mpsc::Sender<Result<Bytes, Infallible>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(f(tx));
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(ReceiverStream::new(rx)),
    )
        .into_response()
}

async fn line(tx: &mpsc::Sender<Result<Bytes, Infallible>>, v: &Value) -> bool {
    let mut s = v.to_string();
    s.push('\n');
    tx.send(Ok(Bytes::from(s))).await.is_ok()
}

/// Which endpoint's shape.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `/api/chat`: `message`.
    Chat,
    /// `/api/generate`: `response`.
    Generate,
}

/// The fields of the last object: `done`, `done_reason`, counts and durations (ns).
fn final_fields(c: &Choice, n_prompt: usize, t0: Instant) -> Value {
    let reason = match c.finish {
        Some(FinishReason::Length | FinishReason::ContextFull) => "length",
        _ => "stop",
    };
    let total = t0.elapsed().as_nanos() as u64;
    json!({
        "done": true,
        "done_reason": reason,
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": n_prompt,
        "prompt_eval_duration": 0,
        "eval_count": c.usage.completion_tokens,
        "eval_duration": total,
    })
}

fn call_json(t: &kapitsa_engine::ToolCall) -> Value {
    json!({"function": {"name": t.name, "arguments": t.arguments}})
}

/// Submit and answer (streamed as NDJSON or as one object); `n_prompt` is the prompt's length
/// with its images widened.
#[allow(clippy::too_many_arguments)]
async fn run(
    st: Arc<AppState>,
    shape: Shape,
    req: Request,
    n_prompt: usize,
    choice: Choice,
    stream: bool,
    param: &str,
) -> ApiResult<Response> {
    let t0 = Instant::now();
    let merged = if req.constraint.is_some() {
        let st2 = st.clone();
        let param = param.to_string();
        tokio::task::spawn_blocking(move || submit_all_for(&st2, vec![req], &param))
            .await
            .map_err(|e| ApiError::internal(format!("submitting the request failed: {e}")))??
    } else {
        submit_all_for(&st, vec![req], param)?
    };
    let model = st.model.name.clone();
    if stream {
        return Ok(ndjson(move |tx| {
            stream_ollama(st, merged, choice, shape, model, n_prompt, t0, tx)
        }));
    }
    let mut c = choice;
    merged.collect(&st, std::slice::from_mut(&mut c)).await?;
    let r = &c.reply;
    let mut v = final_fields(&c, n_prompt, t0);
    v["model"] = model.into();
    v["created_at"] = now().into();
    match shape {
        Shape::Chat => {
            let mut msg = json!({"role": "assistant", "content": r.content});
            if let Some(th) = r.reasoning.as_ref().filter(|t| !t.is_empty()) {
                msg["thinking"] = th.clone().into();
            }
            if !r.tool_calls.is_empty() {
                msg["tool_calls"] = r.tool_calls.iter().map(call_json).collect();
            }
            v["message"] = msg;
        }
        Shape::Generate => {
            v["response"] = if r.tool_calls.is_empty() {
                r.content.clone().into()
            } else {
                c.raw.clone().into()
            };
            if let Some(th) = r.reasoning.as_ref().filter(|t| !t.is_empty()) {
                v["thinking"] = th.clone().into();
            }
        }
    }
    Ok(Json(v).into_response())
}

#[allow(clippy::too_many_arguments)]
async fn stream_ollama(
    st: Arc<AppState>,
    mut merged: Merged,
    mut c: Choice,
    shape: Shape,
    model: String,
    n_prompt: usize,
    t0: Instant,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let mut cancel = st.cancel_rx();
    let piece = |content: &str, thinking: Option<&str>, calls: Option<Value>| {
        let mut v = json!({"model": model, "created_at": now(), "done": false});
        match shape {
            Shape::Chat => {
                let mut msg = json!({"role": "assistant", "content": content});
                if let Some(t) = thinking {
                    msg["thinking"] = t.into();
                }
                if let Some(cs) = calls {
                    msg["tool_calls"] = cs;
                }
                v["message"] = msg;
            }
            Shape::Generate => {
                v["response"] = content.into();
                if let Some(t) = thinking {
                    v["thinking"] = t.into();
                }
            }
        }
        v
    };
    loop {
        let events = match merged
            .next(std::slice::from_mut(&mut c), &mut cancel, None)
            .await
        {
            Ok(Some((_, e))) => e,
            Ok(None) => break,
            Err(Interrupted::ClientGone) => return,
            Err(Interrupted::Failed(e)) => {
                let _ = line(&tx, &json!({"error": e.message})).await;
                return;
            }
        };
        for e in events {
            let v = match e {
                ReplyEvent::Content(t) => piece(&t, None, None),
                ReplyEvent::Reasoning(t) => piece("", Some(&t), None),
                ReplyEvent::ToolCall(call) if shape == Shape::Chat => {
                    piece("", None, Some(json!([call_json(&call)])))
                }
                ReplyEvent::ToolCall(call) => piece(&call.arguments_json(), None, None),
            };
            if !line(&tx, &v).await {
                return;
            }
        }
        if c.done() {
            break;
        }
    }
    let mut v = piece("", None, None);
    if let (Value::Object(o), Value::Object(f)) = (&mut v, final_fields(&c, n_prompt, t0)) {
        o.extend(f);
    }
    let _ = line(&tx, &v).await;
}

/// `POST /api/chat`.
pub async fn chat(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    chat_inner(st, body).await.unwrap_or_else(fail)
}

async fn chat_inner(st: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let list = f
        .array("messages")?
        .ok_or_else(|| ApiError::bad_param("messages", "'messages' is a required property"))?;
    let mut images = Images::default();
    let msgs = messages(list, &mut images)?;
    images.check(&st)?;
    let o = opts(&f)?;
    let tools = crate::openai::chat_tools(&f)?;
    let mut extra = o.extra.clone();
    if o.format.is_some() {
        response_format::no_thinking(&mut extra);
    }
    st.check_open()?;
    if msgs.is_empty() {
        // Ollama answers an empty chat by loading the model.
        return Ok(Json(json!({"model": st.model.name, "created_at": now(), "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": "load"})).into_response());
    }
    let text = st.render(msgs, tools.as_ref(), extra.as_ref())?;
    let prompt = st.encode(&text)?;
    let prepared = images::prepare(&st, images, &prompt).await?;
    let n_prompt = prepared.n_prompt;
    let room = st.room(n_prompt, "messages")?;
    let model_fmt = st.model.reply_format;
    let fmt = if o.format.is_some() {
        ReplyFormat::plain()
    } else {
        model_fmt
    };
    let sir = fmt.starts_in_reasoning(&text);
    let req = Request {
        prompt,
        sampling: o.sampling,
        max_tokens: o.max_tokens.unwrap_or(room).min(room).max(1),
        stop: o.stop,
        ignore_eos: false,
        top_logprobs: None,
        constraint: o.format,
        spec: Default::default(),
        images: prepared.inputs,
    };
    let choice = Choice::new(fmt, sir, tools.as_ref());
    run(st, Shape::Chat, req, n_prompt, choice, o.stream, "format").await
}

/// `POST /api/generate`.
pub async fn generate(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate_inner(st, body).await.unwrap_or_else(fail)
}

async fn generate_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let prompt = f.str("prompt")?.unwrap_or("");
    let suffix = f.str("suffix")?.unwrap_or("");
    let system = f.str("system")?;
    let raw = f.bool("raw")?.unwrap_or(false);
    let mut images = Images::default();
    if let Some(list) = f.array("images")? {
        images::ollama_images(list, "images", &mut images)?;
    }
    images.check(&st)?;
    if !images.is_empty() && !suffix.is_empty() {
        return Err(f.error("images", "'images' cannot be combined with 'suffix'"));
    }
    let mut o = opts(&f)?;
    st.check_open()?;
    if prompt.is_empty() && suffix.is_empty() && images.is_empty() {
        return Ok(Json(json!({"model": st.model.name, "created_at": now(), "response": "", "done": true, "done_reason": "load"})).into_response());
    }
    let (text, fmt) = if !suffix.is_empty() {
        let ff = fim::format_for(&st, "suffix")?;
        o.stop.extend(ff.stops());
        (ff.prompt(prompt, suffix, &[], ""), ReplyFormat::plain())
    } else if raw || st.model.template.is_none() {
        (
            match st.engine.vision() {
                Some(v) => images::raw_prompt(prompt, images.len(), &v, &st.model.tokenizer),
                None => prompt.to_string(),
            },
            ReplyFormat::plain(),
        )
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = system.filter(|s| !s.is_empty()) {
            msgs.push(json!({"role": "system", "content": s}));
        }
        let mut pieces = vec![Piece::Image; images.len()];
        pieces.push(Piece::Text(prompt.to_string()));
        msgs.push(json!({"role": "user", "content": content_value(pieces)}));
        let mut extra = o.extra.clone();
        if o.format.is_some() {
            response_format::no_thinking(&mut extra);
        }
        let fmt = if o.format.is_some() {
            ReplyFormat::plain()
        } else {
            st.model.reply_format
        };
        (st.render(msgs, None, extra.as_ref())?, fmt)
    };
    let ids = st.encode(&text)?;
    let prepared = images::prepare(&st, images, &ids).await?;
    let n_prompt = prepared.n_prompt;
    let room = st.room(n_prompt, "prompt")?;
    let sir = fmt.starts_in_reasoning(&text);
    let req = Request {
        prompt: ids,
        sampling: o.sampling,
        max_tokens: o.max_tokens.unwrap_or(room).min(room).max(1),
        stop: o.stop,
        ignore_eos: false,
        top_logprobs: None,
        constraint: o.format,
        spec: Default::default(),
        images: prepared.inputs,
    };
    let choice = Choice::new(fmt, sir, None);
    run(
        st,
        Shape::Generate,
        req,
        n_prompt,
        choice,
        o.stream,
        "format",
    )
    .await
}

/// `POST /api/embed`: `{"model", "input": text or [texts], "dimensions"}` ->
/// `{"model", "embeddings", "prompt_eval_count"}`.
pub async fn embed(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    embed_inner(st, body, false).await.unwrap_or_else(fail)
}

/// `POST /api/embeddings` (the older form): `{"model", "prompt"}` -> `{"embedding"}`.
pub async fn embeddings_legacy(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    embed_inner(st, body, true).await.unwrap_or_else(fail)
}

async fn embed_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    legacy: bool,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let key = if legacy { "prompt" } else { "input" };
    let toks = embeddings::inputs(&st, f.required(key)?, key)?;
    let dimensions = f
        .int_in("dimensions", 1, i64::from(u32::MAX))?
        .map(|d| d as usize);
    st.check_open()?;
    let n: usize = toks.iter().map(Vec::len).sum();
    let vecs = embeddings::embed(&st, toks, dimensions, key).await?;
    if legacy {
        let v = vecs.into_iter().next().unwrap_or_default();
        return Ok(Json(json!({"embedding": v})).into_response());
    }
    Ok(
        Json(json!({"model": st.model.name, "embeddings": vecs, "prompt_eval_count": n}))
            .into_response(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_207_378), "2026-12-02T10:29:38Z");
    }
}
