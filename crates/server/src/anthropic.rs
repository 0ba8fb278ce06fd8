//! Anthropic Messages API: `/v1/messages` (streaming or not) and
//! `/v1/messages/count_tokens`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kapitsa_engine::{ReplyEvent, SamplingParams};
use serde_json::{json, Map, Value};

use crate::engine::{FinishReason, Request};
use crate::error::{Api, ApiError, ApiResult};
use crate::gen::{
    new_id, random_u64, send, sse_response, submit_all_announced, which_stop, Choice, Interrupted,
    Merged, SseTx,
};
use crate::images::{self, content_value, Images, Piece};
use crate::params::{parse_body, type_name, Fields};
use crate::tool_choice::{self, ToolPolicy};
use crate::{body_bytes, response_format, AppState};

/// A request converted for the chat template.
struct Conversation {
    messages: Vec<Value>,
    /// Every tool, in OpenAI form (`{"type": "function", "function": {...}}`).
    tools: Option<Value>,
    /// `tool_choice`.
    policy: ToolPolicy,
    /// Template variables (`enable_thinking`).
    extra: Option<Value>,
    /// The images of user messages, in order.
    images: Images,
}

impl Conversation {
    /// The tools the template shows the model (none with tool_choice `none`).
    fn prompt_tools(&self) -> Option<&Value> {
        self.policy.prompt_tools(self.tools.as_ref())
    }
}

/// The first text of the system block Claude Code puts before its real system prompt
/// (`x-anthropic-billing-header: cc_version=...; cch=HASH;`, the hash changing per prompt):
/// such blocks are left out of the prompt, so that sessions share the prefix cache.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// The text of a `document` block: a `text` source (`data`), or a `content` source of text
/// blocks, preceded by its `title` and `context` when given.
fn document_text(bf: &Fields, bp: &str) -> ApiResult<String> {
    let src = bf
        .object("source")?
        .ok_or_else(|| bf.error("source", format!("'{bp}.source' is a required property")))?;
    let sp = format!("{bp}.source.");
    let sf = Fields::nested(src, &sp);
    let body = match sf.str("type")? {
        Some("text") => sf
            .str("data")?
            .ok_or_else(|| sf.error("data", format!("'{bp}.source.data' is a required property")))?
            .to_string(),
        Some("content") => block_text(sf.get("content"), &format!("{bp}.source.content"))?,
        Some(other) => {
            return Err(sf.error(
                "type",
                format!("document sources of type '{other}' are not supported: this server serves a text-only model (use a 'text' or 'content' source)"),
            ))
        }
        None => return Err(sf.error("type", format!("'{bp}.source.type' is a required property"))),
    };
    let mut parts = Vec::new();
    if let Some(t) = bf.str("title")?.filter(|t| !t.is_empty()) {
        parts.push(t.to_string());
    }
    if let Some(c) = bf.str("context")?.filter(|c| !c.is_empty()) {
        parts.push(c.to_string());
    }
    parts.push(body);
    Ok(parts.join("\n\n"))
}

/// The text of a `tool_result` content or a `system` value: a string or text blocks (blocks
/// starting with [`BILLING_HEADER`] left out).
fn block_text(v: Option<&Value>, param: &str) -> ApiResult<String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) => {
            let mut out = Vec::new();
            for (i, b) in a.iter().enumerate() {
                let p = format!("{param}[{i}]");
                let ty = b.get("type").and_then(Value::as_str).unwrap_or("");
                match (ty, b.get("text")) {
                    ("text", Some(Value::String(t))) if t.starts_with(BILLING_HEADER) => {}
                    ("text", Some(Value::String(t))) => out.push(t.clone()),
                    ("text", _) => {
                        return Err(ApiError::bad_param(
                            &p,
                            format!("'{p}.text' must be a string"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::bad_param(
                            &p,
                            format!(
                                "content blocks of type '{ty}' are not supported here (text only)"
                            ),
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
        }
        Some(v) => Err(ApiError::bad_param(
            param,
            format!(
                "'{param}' must be a string or an array of text blocks, got {}",
                type_name(v)
            ),
        )),
    }
}

/// Convert `system`, `messages`, `tools`, `tool_choice` and `thinking`.
fn conversation(f: &Fields) -> ApiResult<Conversation> {
    let mut messages = Vec::new();
    let system = block_text(f.get("system"), "system")?;
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    let list = f
        .array("messages")?
        .ok_or_else(|| ApiError::bad_param("messages", "'messages' is a required property"))?;
    if list.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut images = Images::default();
    for (i, m) in list.iter().enumerate() {
        convert_message(i, m, &mut messages, &mut images)?;
    }
    let tools = convert_tools(f)?;
    let policy = tool_choice::anthropic(f.object("tool_choice")?, tools.as_ref())?;
    let mut extra = thinking(f)?;
    if policy.choice.forces_call() {
        response_format::no_thinking(&mut extra);
    }
    Ok(Conversation {
        messages,
        tools,
        policy,
        extra,
        images,
    })
}

/// `thinking` -> the template variable `enable_thinking`: `enabled` (with an optional
/// `budget_tokens` >= 1) sets it, `disabled` clears it, `adaptive` (the model decides) leaves
/// the template's default.
fn thinking(f: &Fields) -> ApiResult<Option<Value>> {
    let Some(t) = f.object("thinking")? else {
        return Ok(None);
    };
    let tf = Fields::nested(t, "thinking.");
    match tf.str("type")? {
        Some("enabled") => {
            tf.int_in("budget_tokens", 1, i64::from(u32::MAX))?;
            Ok(Some(json!({"enable_thinking": true})))
        }
        Some("disabled") => Ok(Some(json!({"enable_thinking": false}))),
        Some("adaptive") => Ok(None),
        _ => Err(f.error(
            "thinking",
            "'thinking.type' must be 'enabled', 'adaptive' or 'disabled'",
        )),
    }
}

/// Convert `messages[i]` into chat-template messages appended to `out`: a `system` message
/// (Claude Code sends some inside `messages`) stays where it is (see [`prompt`] for templates
/// that refuse that), tool results become `tool` messages, images of user messages go to
/// `images` (the message's content becomes a list with an `{"type": "image"}` item there).
fn convert_message(
    i: usize,
    m: &Value,
    out: &mut Vec<Value>,
    images: &mut Images,
) -> ApiResult<()> {
    let p = format!("messages[{i}]");
    let Value::Object(obj) = m else {
        return Err(ApiError::bad_param(&p, format!("'{p}' must be an object")));
    };
    let prefix = format!("{p}.");
    let mf = Fields::nested(obj, &prefix);
    let role = mf
        .str("role")?
        .ok_or_else(|| mf.error("role", format!("'{p}.role' is a required property")))?;
    if role == "system" {
        let text = block_text(Some(mf.required("content")?), &format!("{p}.content"))?;
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
        return Ok(());
    }
    if role != "user" && role != "assistant" {
        return Err(mf.error(
            "role",
            format!("unknown role '{role}' (expected 'user', 'assistant' or 'system')"),
        ));
    }
    let content = mf.required("content")?;
    let blocks: Vec<Value> = match content {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(a) => a.clone(),
        v => {
            return Err(mf.error(
                "content",
                format!(
                    "'{p}.content' must be a string or an array of content blocks, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let mut pieces = Vec::new();
    let mut reasoning = Vec::new();
    let mut calls = Vec::new();
    let mut results = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{p}.content[{j}]");
        let Value::Object(bo) = b else {
            return Err(ApiError::bad_param(
                &bp,
                format!("'{bp}' must be an object"),
            ));
        };
        let bprefix = format!("{bp}.");
        let bf = Fields::nested(bo, &bprefix);
        let ty = bf
            .str("type")?
            .ok_or_else(|| bf.error("type", format!("'{bp}.type' is a required property")))?;
        match (ty, role) {
            ("text", _) => pieces.push(Piece::Text(
                bf.str("text")?
                    .ok_or_else(|| bf.error("text", format!("'{bp}.text' is a required property")))?
                    .to_string(),
            )),
            ("document", _) => pieces.push(Piece::Text(document_text(&bf, &bp)?)),
            ("thinking", "assistant") => {
                reasoning.push(bf.str("thinking")?.unwrap_or("").to_string())
            }
            ("redacted_thinking", "assistant") => {}
            ("tool_use", "assistant") => {
                let name = bf.str("name")?.ok_or_else(|| {
                    bf.error("name", format!("'{bp}.name' is a required property"))
                })?;
                let input = bf.object("input")?.cloned().unwrap_or_default();
                let mut c = json!({
                    "type": "function",
                    "function": {"name": name, "arguments": Value::Object(input)},
                });
                if let Some(id) = bf.str("id")? {
                    c["id"] = id.into();
                }
                calls.push(c);
            }
            ("tool_result", "user") => {
                let id = bf.str("tool_use_id")?.ok_or_else(|| {
                    bf.error(
                        "tool_use_id",
                        format!("'{bp}.tool_use_id' is a required property"),
                    )
                })?;
                let mut text = block_text(bf.get("content"), &format!("{bp}.content"))?;
                if bf.bool("is_error")?.unwrap_or(false) {
                    text = format!("Error: {text}");
                }
                results.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            }
            ("image", "user") => {
                images.push(images::anthropic_image(b, &bp)?, bp.clone());
                pieces.push(Piece::Image);
            }
            ("image", _) => {
                return Err(ApiError::bad_param(
                    &bp,
                    format!("'{bp}': image blocks are only accepted in user messages"),
                ))
            }
            _ => {
                return Err(ApiError::bad_param(
                    &bp,
                    format!("content blocks of type '{ty}' are not allowed in a '{role}' message"),
                ))
            }
        }
    }
    if role == "user" {
        out.extend(results);
        if !pieces.is_empty() {
            out.push(json!({"role": "user", "content": content_value(pieces)}));
        }
    } else {
        let mut msg = Map::new();
        msg.insert("role".into(), "assistant".into());
        msg.insert("content".into(), content_value(pieces));
        if !reasoning.is_empty() {
            msg.insert("reasoning_content".into(), reasoning.join("\n").into());
        }
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(msg));
    }
    Ok(())
}

/// `tools` in OpenAI form (`None` when there are none).
fn convert_tools(f: &Fields) -> ApiResult<Option<Value>> {
    let Some(list) = f.array("tools")? else {
        return Ok(None);
    };
    let mut conv = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(to) = t else {
            return Err(ApiError::bad_param(&p, format!("'{p}' must be an object")));
        };
        let prefix = format!("{p}.");
        let tf = Fields::nested(to, &prefix);
        if let Some(ty) = tf.str("type")? {
            if ty != "custom" {
                return Err(tf.error(
                    "type",
                    format!("tools of type '{ty}' are not supported (only client tools with an input_schema)"),
                ));
            }
        }
        let name = tf
            .str("name")?
            .filter(|n| !n.is_empty())
            .ok_or_else(|| tf.error("name", format!("'{p}.name' is a required property")))?;
        let schema = tf.object("input_schema")?.ok_or_else(|| {
            tf.error(
                "input_schema",
                format!("'{p}.input_schema' is a required property"),
            )
        })?;
        // Key order as OpenAI clients send it (the template prints the tools as JSON).
        let mut func = Map::new();
        func.insert("name".into(), name.into());
        if let Some(d) = tf.str("description")? {
            func.insert("description".into(), d.into());
        }
        func.insert("parameters".into(), Value::Object(schema.clone()));
        let func = Value::Object(func);
        conv.push(json!({"type": "function", "function": func}));
    }
    Ok((!conv.is_empty()).then_some(Value::Array(conv)))
}

/// `messages` with every `system` message after the first position merged into the leading
/// system message (blank-line separated), for templates that only take a system prompt at
/// the start.
fn merge_system(messages: &[Value]) -> Vec<Value> {
    let mut system = Vec::new();
    let mut rest = Vec::new();
    for m in messages {
        if m["role"] == "system" {
            system.push(m["content"].as_str().unwrap_or("").to_string());
        } else {
            rest.push(m.clone());
        }
    }
    let mut out = Vec::with_capacity(rest.len() + 1);
    if !system.is_empty() {
        out.push(json!({"role": "system", "content": system.join("\n\n")}));
    }
    out.extend(rest);
    out
}

/// Render and tokenize a conversation; returns the prompt text and tokens. `system`
/// messages are rendered where they stand; when the template refuses that (Qwen3.5's raises
/// "System message must be at the beginning"), they are merged into the leading system
/// message instead.
fn prompt(st: &AppState, c: &Conversation) -> ApiResult<(String, Vec<u32>)> {
    let late_system = c.messages.iter().skip(1).any(|m| m["role"] == "system");
    let text = match st.render(c.messages.clone(), c.prompt_tools(), c.extra.as_ref()) {
        Err(_) if late_system => st.render(
            merge_system(&c.messages),
            c.prompt_tools(),
            c.extra.as_ref(),
        )?,
        r => r?,
    };
    let ids = st.encode(&text)?;
    Ok((text, ids))
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    count_tokens_inner(st, body)
        .await
        .unwrap_or_else(|e| e.into_response_for(Api::Anthropic))
}

async fn count_tokens_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let mut c = conversation(&f)?;
    c.images.check(&st)?;
    let (_, ids) = prompt(&st, &c)?;
    // Images count as the tokens the engine widens them to.
    let prepared = images::prepare(&st, std::mem::take(&mut c.images), &ids).await?;
    Ok(Json(json!({"input_tokens": prepared.n_prompt})).into_response())
}

/// `POST /v1/messages`.
pub async fn messages(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match messages_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response_for(Api::Anthropic),
    }
}

fn stop_reason(f: &FinishReason, tool_calls: bool) -> &'static str {
    match f {
        FinishReason::Length | FinishReason::ContextFull => "max_tokens",
        FinishReason::StopString => "stop_sequence",
        FinishReason::EndOfGeneration if tool_calls => "tool_use",
        FinishReason::EndOfGeneration => "end_turn",
    }
}

fn usage_json(input: usize, output: usize, cached: usize) -> Value {
    json!({
        "input_tokens": input,
        "output_tokens": output,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    })
}

async fn messages_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let max_tokens = f
        .int_in("max_tokens", 1, i64::from(u32::MAX))?
        .ok_or_else(|| ApiError::bad_param("max_tokens", "max_tokens: Field required"))?
        as usize;
    let mut conv = conversation(&f)?;
    conv.images.check(&st)?;
    let mut s = SamplingParams::default();
    if let Some(t) = f.f32_in("temperature", 0.0, 1.0)? {
        s.temperature = t;
    }
    if let Some(p) = f.f32_in("top_p", 0.0, 1.0)? {
        s.top_p = p.max(1e-6);
    }
    if let Some(k) = f.int_in("top_k", 0, i64::from(u32::MAX))? {
        s.top_k = k as usize;
    }
    s.seed = random_u64();
    s.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let stops = f.strings("stop_sequences", 16)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    st.check_open()?;
    let (text, ids) = prompt(&st, &conv)?;
    let prepared = images::prepare(&st, std::mem::take(&mut conv.images), &ids).await?;
    let n_prompt = prepared.n_prompt;
    let room = st.room(n_prompt, "messages")?;
    let fmt = st.model.reply_format;
    let constraint = tool_choice::constraint(&conv.policy, conv.tools.as_ref(), fmt, &text)?;
    let req = Request {
        prompt: ids.clone(),
        sampling: s,
        max_tokens: max_tokens.min(room),
        stop: stops.clone(),
        ignore_eos: false,
        top_logprobs: None,
        constraint,
        spec: crate::params::spec_field(&f)?,
        images: prepared.inputs,
    };
    let merged = if req.constraint.is_some() {
        // Compiling the constraint (and, the first time, building the token trie) blocks.
        let st2 = st.clone();
        tokio::task::spawn_blocking(move || {
            submit_all_announced(&st2, vec![req], tool_choice::PARAM)
        })
        .await
        .map_err(|e| ApiError::internal(format!("submitting the request failed: {e}")))??
    } else {
        submit_all_announced(&st, vec![req], tool_choice::PARAM)?
    };
    let choice = Choice::new(fmt, fmt.starts_in_reasoning(&text), conv.prompt_tools());
    let id = new_id("msg_");
    if stream {
        let st2 = st.clone();
        return Ok(sse_response(move |tx| {
            stream_messages(st2, merged, choice, id, n_prompt, stops, tx)
        }));
    }
    let mut c = choice;
    merged.collect(&st, std::slice::from_mut(&mut c)).await?;
    let finish = c
        .finish
        .clone()
        .ok_or_else(|| ApiError::internal("the reply has no end"))?;
    let r = &c.reply;
    let mut content = Vec::new();
    if let Some(th) = r.reasoning.as_ref().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": th, "signature": ""}));
    }
    if !r.content.is_empty() {
        content.push(json!({"type": "text", "text": r.content}));
    }
    for t in &r.tool_calls {
        content.push(json!({"type": "tool_use", "id": new_id("toolu_"), "name": t.name, "input": t.arguments}));
    }
    let stop_seq = (finish == FinishReason::StopString)
        .then(|| which_stop(&st.model.tokenizer, &c, &stops))
        .flatten();
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": st.model.name,
        "content": content,
        "stop_reason": stop_reason(&finish, !r.tool_calls.is_empty()),
        "stop_sequence": stop_seq,
        "usage": usage_json(n_prompt, c.usage.completion_tokens, c.usage.cached_tokens),
    }))
    .into_response())
}

fn event(name: &str, v: Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}

/// The open content block of a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    None,
    Thinking,
    Text,
}

/// How often (by default, [`crate::ServerConfig::ping_every`]) a stream sends `event: ping`
/// while nothing else is sent (Claude Code gives up on
/// a stream that stays silent for long, e.g. during the prefill of a long prompt).
pub const PING_EVERY: Duration = Duration::from_secs(5);

/// Stream a message: `message_start` (once the request has a cache slot, so that its
/// `cache_read_input_tokens` is known, or after [`PING_EVERY`] in the queue), `ping`, then per
/// block `content_block_start`, `content_block_delta`s and `content_block_stop`, then
/// `message_delta` and `message_stop`; a `ping` whenever nothing was sent for [`PING_EVERY`].
async fn stream_messages(
    st: Arc<AppState>,
    mut merged: Merged,
    mut c: Choice,
    id: String,
    n_prompt: usize,
    stops: Vec<String>,
    tx: SseTx,
) {
    let start = |cached: usize| {
        let start = json!({
            "type": "message_start",
            "message": {
                "id": id,
                "type": "message",
                "role": "assistant",
                "model": st.model.name,
                "content": [],
                "stop_reason": Value::Null,
                "stop_sequence": Value::Null,
                "usage": usage_json(n_prompt, 0, cached),
            },
        });
        event("message_start", start)
    };
    let ping = || event("ping", json!({"type": "ping"}));
    let mut started = false;
    let mut open = Block::None;
    let mut index: usize = 0;
    let mut n_calls = 0;
    let mut cancel = st.cancel_rx();
    let error = |e: &ApiError| event("error", e.body(Api::Anthropic));
    loop {
        let one = std::slice::from_mut(&mut c);
        // `next` is cancel-safe: an event is taken into the choice in the same poll that
        // receives it.
        let next =
            tokio::time::timeout(st.cfg.ping_every, merged.next(one, &mut cancel, Some(&tx)));
        let events = match next.await {
            Err(_) => {
                let mut out = Vec::new();
                if !started {
                    started = true;
                    out.push(start(0));
                }
                out.push(ping());
                for ev in out {
                    if !send(&tx, ev).await {
                        return;
                    }
                }
                continue;
            }
            Ok(Ok(Some((_, events)))) => events,
            Ok(Ok(None)) => break,
            Ok(Err(Interrupted::ClientGone)) => return,
            Ok(Err(Interrupted::Failed(e))) => {
                if !started && !send(&tx, start(0)).await {
                    return;
                }
                let _ = send(&tx, error(&e)).await;
                return;
            }
        };
        if !started {
            started = true;
            let cached = c.admitted.or(c.done().then_some(c.usage.cached_tokens));
            if !send(&tx, start(cached.unwrap_or(0))).await || !send(&tx, ping()).await {
                return;
            }
        }
        for e in events {
            let mut out = Vec::new();
            let want = match &e {
                ReplyEvent::Reasoning(_) => Block::Thinking,
                ReplyEvent::Content(_) => Block::Text,
                ReplyEvent::ToolCall(_) => Block::None,
            };
            if open != Block::None && open != want {
                out.push(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ));
                index += 1;
                open = Block::None;
            }
            if open == Block::None && want != Block::None {
                let block = if want == Block::Thinking {
                    json!({"type": "thinking", "thinking": "", "signature": ""})
                } else {
                    json!({"type": "text", "text": ""})
                };
                out.push(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                open = want;
            }
            match e {
                ReplyEvent::Reasoning(t) => out.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": t}}),
                )),
                ReplyEvent::Content(t) => out.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}}),
                )),
                ReplyEvent::ToolCall(call) => {
                    n_calls += 1;
                    out.push(event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": {
                            "type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": {},
                        }}),
                    ));
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": {
                            "type": "input_json_delta", "partial_json": call.arguments_json(),
                        }}),
                    ));
                    out.push(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index}),
                    ));
                    index += 1;
                }
            }
            for ev in out {
                if !send(&tx, ev).await {
                    return;
                }
            }
        }
        if c.done() {
            break;
        }
    }
    let Some(finish) = c.finish.clone() else {
        // (Not reached: `next` ends only once the choice is done.)
        if !started {
            let _ = send(&tx, start(0)).await;
        }
        let _ = send(&tx, error(&ApiError::internal("the reply has no end"))).await;
        return;
    };
    if open != Block::None
        && !send(
            &tx,
            event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ),
        )
        .await
    {
        return;
    }
    let stop_seq = (finish == FinishReason::StopString)
        .then(|| which_stop(&st.model.tokenizer, &c, &stops))
        .flatten();
    let delta = json!({
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason(&finish, n_calls > 0), "stop_sequence": stop_seq},
        "usage": {
            "output_tokens": c.usage.completion_tokens,
            "input_tokens": n_prompt,
            "cache_read_input_tokens": c.usage.cached_tokens,
        },
    });
    if send(&tx, event("message_delta", delta)).await {
        let _ = send(&tx, event("message_stop", json!({"type": "message_stop"}))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversation_with_tools() {
        let v = json!({
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather in Bern?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "call it", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Bern"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "thanks"},
                ]},
            ],
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        });
        let c = conversation(&Fields::new(v.as_object().unwrap())).unwrap();
        assert_eq!(
            c.messages[0],
            json!({"role": "system", "content": "be brief"})
        );
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"]["city"],
            "Bern"
        );
        assert_eq!(c.messages[2]["reasoning_content"], "call it");
        assert_eq!(
            c.messages[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(c.messages[4], json!({"role": "user", "content": "thanks"}));
        assert_eq!(
            c.tools.unwrap()[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(c.extra.unwrap()["enable_thinking"], true);
        let bad = json!({"messages": [{"role": "robot", "content": "x"}]});
        assert!(conversation(&Fields::new(bad.as_object().unwrap())).is_err());
    }

    /// Claude Code's shapes: the billing-header system block is dropped, `system` messages
    /// stay in place (or merge into the system prompt), documents become text, `adaptive`
    /// thinking leaves the template default.
    #[test]
    fn claude_code_shapes() {
        let v = json!({
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=ab12;"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {"role": "user", "content": [
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "file body"}, "title": "a.txt"},
                    {"type": "text", "text": "summarise"},
                ]},
                {"role": "system", "content": "Reminder: be terse."},
                {"role": "assistant", "content": "ok"},
            ],
            "thinking": {"type": "adaptive"},
        });
        let c = conversation(&Fields::new(v.as_object().unwrap())).unwrap();
        assert_eq!(
            c.messages[0],
            json!({"role": "system", "content": "You are Claude Code."})
        );
        assert_eq!(
            c.messages[1],
            json!({"role": "user", "content": "a.txt\n\nfile body\nsummarise"})
        );
        assert_eq!(
            c.messages[2],
            json!({"role": "system", "content": "Reminder: be terse."})
        );
        assert_eq!(c.extra, None);
        let merged = merge_system(&c.messages);
        assert_eq!(merged.len(), 3);
        assert_eq!(
            merged[0]["content"],
            "You are Claude Code.\n\nReminder: be terse."
        );
        assert_eq!(merged[1]["role"], "user");
        for bad in [
            json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}}),
            json!({"type": "document", "source": {"type": "text"}}),
            json!({"type": "document"}),
        ] {
            let v = json!({"messages": [{"role": "user", "content": [bad]}]});
            assert!(conversation(&Fields::new(v.as_object().unwrap())).is_err());
        }
        let v = json!({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 0}});
        assert!(conversation(&Fields::new(v.as_object().unwrap())).is_err());
    }
}
