//! OpenAI endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kapitsa_engine::{Constraint, ReplyEvent, ReplyFormat, SamplingParams};
use serde_json::{json, Map, Value};

use crate::engine::{ImageInput, Request, MAX_TOP_LOGPROBS};
use crate::error::{Api, ApiError, ApiResult};
use crate::gen::{
    chat_logprobs, completion_logprobs, new_id, openai_finish, random_u64, send, sse_response,
    submit_all, submit_all_for, unix_now, Choice, Interrupted, Merged, SseTx,
};
use crate::images::{self, content_value, Images, Piece};
use crate::params::{parse_body, token_ids, type_name, Fields};
use crate::{body_bytes, response_format, tool_choice, AppState};

/// Most choices (`n`) one request may ask for.
pub const MAX_N: i64 = 16;
/// Most stop strings one request may give.
pub const MAX_STOP: usize = 16;
/// `max_tokens` of `/v1/completions` when not given (OpenAI's default).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// Generation settings shared by the OpenAI endpoints.
#[derive(Debug, Clone)]
pub struct GenOpts {
    /// Sampling (the seed is that of choice 0; choice `i` uses `seed + i`).
    pub sampling: SamplingParams,
    /// Requested `max_tokens` (`None`: up to the context, or 16 for completions).
    pub max_tokens: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Choices per prompt.
    pub n: usize,
    /// `Some(k)`: logprobs with `k` alternatives.
    pub top_logprobs: Option<usize>,
    /// Ignore end-of-generation tokens.
    pub ignore_eos: bool,
    /// Stream with SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Structured output (`response_format`, or a forced tool call in chat); `None` here, set
    /// by the endpoints.
    pub constraint: Option<Constraint>,
    /// The `speculative` extension field.
    pub spec: kapitsa_engine::SpecRequest,
}

/// The sampling fields OpenAI-style and Ollama requests share (`temperature`, `top_p`,
/// `top_k`, `min_p`, `presence_penalty`, `frequency_penalty` and the repetition penalty under
/// `rep_key`) into `s`, each range-checked.
pub fn sampling_fields(f: &Fields, rep_key: &str, s: &mut SamplingParams) -> ApiResult<()> {
    if let Some(t) = f.f32_in("temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = f.f32_in("top_p", 0.0, 1.0)? {
        // top_p = 0 keeps the single most likely token.
        s.top_p = p.max(1e-6);
    }
    if let Some(k) = f.int_in("top_k", -1, i64::from(u32::MAX))? {
        s.top_k = k.max(0) as usize;
    }
    if let Some(p) = f.f32_in("min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(p) = f.f32_in("presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = f.f32_in("frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = f.f32(rep_key)? {
        if p <= 0.0 {
            return Err(f.error(rep_key, format!("'{}' must be > 0", f.param(rep_key))));
        }
        s.repetition_penalty = p;
    }
    Ok(())
}

/// Read the sampling and generation fields common to OpenAI requests. `chat`: logprobs is a
/// boolean plus `top_logprobs` (chat), else an integer (completions). `n_vocab`: the
/// tokenizer's vocabulary size (`logit_bias` keys must be below it).
pub fn gen_opts(f: &Fields, chat: bool, n_vocab: usize) -> ApiResult<GenOpts> {
    let mut s = SamplingParams::default();
    sampling_fields(f, "repetition_penalty", &mut s)?;
    s.seed = match f.i64("seed")? {
        Some(x) => x as u64,
        None => random_u64(),
    };
    s.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let mut max_tokens = None;
    let keys: &[&str] = if chat {
        &["max_completion_tokens", "max_tokens"]
    } else {
        &["max_tokens"]
    };
    for k in keys {
        if let Some(m) = f.int_in(k, 1, i64::from(u32::MAX))? {
            max_tokens = Some(m as usize);
            break;
        }
    }
    let stop = f.strings("stop", MAX_STOP)?;
    let n = f.int_in("n", 1, MAX_N)?.unwrap_or(1) as usize;
    let max_lp = MAX_TOP_LOGPROBS as i64;
    let top_logprobs = if chat {
        let on = f.bool("logprobs")?.unwrap_or(false);
        let k = f.int_in("top_logprobs", 0, max_lp)?;
        if k.is_some() && !on {
            return Err(f.error(
                "top_logprobs",
                "'top_logprobs' requires 'logprobs' to be true",
            ));
        }
        on.then_some(k.unwrap_or(0) as usize)
    } else {
        f.int_in("logprobs", 0, max_lp)?.map(|k| k as usize)
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => Fields::nested(o, "stream_options.")
            .bool("include_usage")?
            .unwrap_or(false),
        None => false,
    };
    if let Some(b) = f.object("logit_bias")? {
        s.logit_bias = logit_bias(b, n_vocab)?;
    }
    Ok(GenOpts {
        sampling: s,
        max_tokens,
        stop,
        n,
        top_logprobs,
        ignore_eos,
        stream,
        include_usage,
        constraint: None,
        spec: crate::params::spec_field(f)?,
    })
}

/// Most entries of `logit_bias` (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// OpenAI `logit_bias`: token id (a decimal string) -> bias in [-100, 100].
fn logit_bias(b: &Map<String, Value>, n_vocab: usize) -> ApiResult<Vec<(u32, f32)>> {
    if b.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::bad_param(
            "logit_bias",
            format!("'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens"),
        ));
    }
    b.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < n_vocab)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "logit_bias",
                        format!(
                            "'logit_bias' key '{k}' is not a token id (an integer below {n_vocab})"
                        ),
                    )
                })?;
            let bias = v
                .as_f64()
                .filter(|x| (-100.0..=100.0).contains(x))
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "logit_bias",
                        format!("'logit_bias' value of token {k} must be a number in [-100, 100]"),
                    )
                })?;
            Ok((id, bias as f32))
        })
        .collect()
}

/// The engine requests of one prompt (with its images): `n` of them, seeds `seed + i`.
fn requests(
    o: &GenOpts,
    prompt: &[u32],
    images: &[ImageInput],
    room: usize,
    default_max: usize,
) -> Vec<Request> {
    let max_tokens = o.max_tokens.unwrap_or(default_max).min(room).max(1);
    (0..o.n)
        .map(|i| {
            let mut sampling = o.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(i as u64);
            Request {
                prompt: prompt.to_vec(),
                sampling,
                max_tokens,
                stop: o.stop.clone(),
                ignore_eos: o.ignore_eos,
                top_logprobs: o.top_logprobs,
                constraint: o.constraint.clone(),
                spec: o.spec,
                images: images.to_vec(),
            }
        })
        .collect()
}

/// The text of a `content` field: a string, or an array of text parts joined with newlines
/// (image parts refused: see [`content_pieces`]).
pub fn text_content(v: Option<&Value>, param: &str) -> ApiResult<String> {
    let pieces = content_pieces(v, param, None)?;
    Ok(pieces
        .into_iter()
        .filter_map(|p| match p {
            Piece::Text(t) => Some(t),
            Piece::Image => None,
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// The pieces of a `content` field: a string, or an array of text and image parts. Image parts
/// (`image_url`, the Responses API's `input_image`) go to `images` and leave a
/// [`Piece::Image`]; with `images` `None` (not a user message) they are refused.
pub fn content_pieces(
    v: Option<&Value>,
    param: &str,
    mut images: Option<&mut Images>,
) -> ApiResult<Vec<Piece>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![Piece::Text(s.clone())]),
        Some(Value::Array(parts)) => {
            let mut pieces = Vec::new();
            for (i, p) in parts.iter().enumerate() {
                let pp = format!("{param}[{i}]");
                let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                match ty {
                    "text" | "input_text" | "output_text" => match p.get("text") {
                        Some(Value::String(t)) => pieces.push(Piece::Text(t.clone())),
                        _ => {
                            return Err(ApiError::bad_param(
                                &pp,
                                format!("'{pp}.text' must be a string"),
                            ))
                        }
                    },
                    "refusal" => {}
                    "image_url" | "input_image" => {
                        let Some(imgs) = images.as_deref_mut() else {
                            return Err(ApiError::bad_param(
                                &pp,
                                format!("'{pp}': image parts are only accepted in user messages"),
                            ));
                        };
                        let source = if ty == "image_url" {
                            images::openai_image_url(p, &pp)?
                        } else {
                            images::responses_input_image(p, &pp)?
                        };
                        imgs.push(source, pp);
                        pieces.push(Piece::Image);
                    }
                    "input_audio" | "file" | "input_file" | "image" => {
                        return Err(ApiError::bad_param(
                            &pp,
                            format!("content parts of type '{ty}' are not supported (images go in parts of type 'image_url')"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::bad_param(
                            &pp,
                            format!("unknown content part type '{ty}'"),
                        ))
                    }
                }
            }
            Ok(pieces)
        }
        Some(v) => Err(ApiError::bad_param(
            param,
            format!(
                "'{param}' must be a string or an array of content parts, got {}",
                type_name(v)
            ),
        )),
    }
}

/// OpenAI messages -> the messages the chat templates expect (string contents, or content
/// lists for user messages with images, which go to `images`; tool-call arguments as objects).
fn chat_messages(list: &[Value], images: &mut Images) -> ApiResult<Vec<Value>> {
    if list.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(obj) = m else {
            return Err(ApiError::bad_param(&p, format!("'{p}' must be an object")));
        };
        let prefix = format!("{p}.");
        let f = Fields::nested(obj, &prefix);
        let role = f
            .str("role")?
            .ok_or_else(|| f.error("role", format!("'{p}.role' is a required property")))?;
        let cp = format!("{p}.content");
        let content = if role == "user" {
            content_value(content_pieces(f.get("content"), &cp, Some(&mut *images))?)
        } else {
            Value::String(text_content(f.get("content"), &cp)?)
        };
        let mut msg = Map::new();
        match role {
            "system" | "developer" => {
                msg.insert("role".into(), "system".into());
                msg.insert("content".into(), content);
            }
            "user" => {
                if f.get("content").is_none() {
                    return Err(f.error("content", format!("'{p}.content' is a required property")));
                }
                msg.insert("role".into(), "user".into());
                msg.insert("content".into(), content);
            }
            "assistant" => {
                msg.insert("role".into(), "assistant".into());
                msg.insert("content".into(), content);
                let reasoning = f.str("reasoning_content")?.or(f.str("reasoning")?);
                if let Some(r) = reasoning {
                    msg.insert("reasoning_content".into(), r.into());
                }
                if let Some(calls) = f.array("tool_calls")? {
                    let mut conv = Vec::new();
                    for (j, c) in calls.iter().enumerate() {
                        let cp = format!("{p}.tool_calls[{j}]");
                        let func =
                            c.get("function")
                                .and_then(Value::as_object)
                                .ok_or_else(|| {
                                    ApiError::bad_param(
                                        &cp,
                                        format!("'{cp}.function' must be an object"),
                                    )
                                })?;
                        let name = func.get("name").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::bad_param(
                                &cp,
                                format!("'{cp}.function.name' must be a string"),
                            )
                        })?;
                        let args = match func.get("arguments") {
                            None | Some(Value::Null) => json!({}),
                            Some(Value::String(s)) if s.trim().is_empty() => json!({}),
                            Some(Value::String(s)) => {
                                serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
                            }
                            Some(v) => v.clone(),
                        };
                        let mut e = json!({
                            "type": "function",
                            "function": {"name": name, "arguments": args},
                        });
                        if let Some(id) = c.get("id").and_then(Value::as_str) {
                            e["id"] = id.into();
                        }
                        conv.push(e);
                    }
                    if !conv.is_empty() {
                        msg.insert("tool_calls".into(), Value::Array(conv));
                    }
                }
            }
            "tool" | "function" => {
                msg.insert("role".into(), "tool".into());
                msg.insert("content".into(), content);
                if let Some(id) = f.str("tool_call_id")? {
                    msg.insert("tool_call_id".into(), id.into());
                }
                if let Some(n) = f.str("name")? {
                    msg.insert("name".into(), n.into());
                }
            }
            other => {
                return Err(f.error(
                    "role",
                    format!(
                    "unknown role '{other}' (expected system, developer, user, assistant or tool)"
                ),
                ))
            }
        }
        if let Some(n) = f.str("name")? {
            msg.entry("name").or_insert_with(|| n.into());
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

/// Check `tools` (OpenAI function tools); returns them (`None` when there are none).
/// `tool_choice` is read by [`tool_choice::openai`].
pub(crate) fn chat_tools(f: &Fields) -> ApiResult<Option<Value>> {
    let Some(tools) = f.array("tools")? else {
        return Ok(None);
    };
    for (i, t) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let ty = t.get("type").and_then(Value::as_str).unwrap_or("function");
        if ty != "function" {
            return Err(ApiError::bad_param(
                &p,
                format!("tools of type '{ty}' are not supported (only 'function')"),
            ));
        }
        let func = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::bad_param(&p, format!("'{p}.function' must be an object")))?;
        match func.get("name") {
            Some(Value::String(n)) if !n.is_empty() => {}
            _ => {
                return Err(ApiError::bad_param(
                    &p,
                    format!("'{p}.function.name' must be a non-empty string"),
                ))
            }
        }
        if let Some(params) = func.get("parameters") {
            if !params.is_object() && !params.is_null() {
                return Err(ApiError::bad_param(
                    &p,
                    format!("'{p}.function.parameters' must be a JSON schema object"),
                ));
            }
        }
    }
    Ok((!tools.is_empty()).then(|| Value::Array(tools.clone())))
}

fn usage_json(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response_for(Api::OpenAi),
    }
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
    let messages = chat_messages(list, &mut images)?;
    images.check(&st)?;
    let tools = chat_tools(&f)?;
    let policy = tool_choice::openai(&f, tools.as_ref())?;
    let prompt_tools = policy.prompt_tools(tools.as_ref());
    let json_format = response_format::parse(&f)?;
    let mut extra = f
        .object("chat_template_kwargs")?
        .map(|o| Value::Object(o.clone()));
    if json_format.is_some() || policy.choice.forces_call() {
        response_format::no_thinking(&mut extra);
    }
    let mut o = gen_opts(&f, true, st.model.tokenizer.vocab_size())?;
    st.check_open()?;
    let text = st.render(messages, prompt_tools, extra.as_ref())?;
    let prompt = st.encode(&text)?;
    let prepared = images::prepare(&st, images, &prompt).await?;
    let n_prompt = prepared.n_prompt;
    let room = st.room(n_prompt, "messages")?;
    // A forced tool call overrides `response_format` (which is about text replies); with
    // `response_format` and tool_choice `auto` / `none` the reply is the JSON, all content:
    // no reasoning, no tool-call markup to find in it.
    let model_fmt = st.model.reply_format;
    let tool_constraint = if json_format.is_none() || policy.choice.forces_call() {
        tool_choice::constraint(&policy, tools.as_ref(), model_fmt, &text)?
    } else {
        None
    };
    let (fmt, constraint_param) = match (&tool_constraint, &json_format) {
        (Some(_), _) => (model_fmt, tool_choice::PARAM),
        (None, Some(_)) => (ReplyFormat::plain(), response_format::PARAM),
        (None, None) => (model_fmt, response_format::PARAM),
    };
    o.constraint = tool_constraint.or(json_format);
    let sir = fmt.starts_in_reasoning(&text);
    let reqs = requests(&o, &prompt, &prepared.inputs, room, room);
    let merged = if o.constraint.is_some() {
        // Compiling the constraint (and, the first time, building the token trie) blocks.
        let st2 = st.clone();
        tokio::task::spawn_blocking(move || submit_all_for(&st2, reqs, constraint_param))
            .await
            .map_err(|e| ApiError::internal(format!("submitting the request failed: {e}")))??
    } else {
        submit_all(&st, reqs)?
    };
    let choices: Vec<Choice> = (0..o.n)
        .map(|_| Choice::new(fmt, sir, prompt_tools))
        .collect();
    let id = new_id("chatcmpl-");
    let created = unix_now();
    if o.stream {
        let st2 = st.clone();
        return Ok(sse_response(move |tx| {
            stream_chat(st2, merged, choices, o, id, created, n_prompt, tx)
        }));
    }
    let mut choices = choices;
    merged.collect(&st, &mut choices).await?;
    let tok = &st.model.tokenizer;
    let mut out = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        let r = &c.reply;
        let mut msg = json!({"role": "assistant", "content": r.content});
        if let Some(reasoning) = &r.reasoning {
            msg["reasoning_content"] = reasoning.clone().into();
        }
        if !r.tool_calls.is_empty() {
            let calls: Vec<Value> = r
                .tool_calls
                .iter()
                .map(|t| {
                    json!({
                        "id": new_id("call_"),
                        "type": "function",
                        "function": {"name": t.name, "arguments": t.arguments_json()},
                    })
                })
                .collect();
            msg["tool_calls"] = Value::Array(calls);
            if r.content.is_empty() {
                msg["content"] = Value::Null;
            }
        }
        // Cannot fail: `collect` returned Ok, which it only does when every choice got
        // `Done` (`done()` is `finish.is_some()`).
        let finish = c.finish.as_ref().expect("collected");
        out.push(json!({
            "index": i,
            "message": msg,
            "logprobs": if o.top_logprobs.is_some() { chat_logprobs(tok, &c.logprobs) } else { Value::Null },
            "finish_reason": openai_finish(finish, !r.tool_calls.is_empty()),
        }));
    }
    let completion: usize = choices.iter().map(|c| c.usage.completion_tokens).sum();
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": st.model.name,
        "system_fingerprint": Value::Null,
        "choices": out,
        "usage": usage_json(n_prompt, completion, choices[0].usage.cached_tokens),
    }))
    .into_response())
}

/// The error chunk of a stream.
fn error_chunk(e: &ApiError) -> SseEvent {
    data(&e.body(Api::OpenAi))
}

#[allow(clippy::too_many_arguments)]
async fn stream_chat(
    st: Arc<AppState>,
    mut merged: Merged,
    mut choices: Vec<Choice>,
    o: GenOpts,
    id: String,
    created: u64,
    n_prompt: usize,
    tx: SseTx,
) {
    let model = st.model.name.clone();
    let tok = st.model.tokenizer.clone();
    let chunk = |choice: Value| {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": Value::Null,
            "choices": [choice],
        });
        if o.include_usage {
            c["usage"] = Value::Null;
        }
        data(&c)
    };
    for i in 0..choices.len() {
        let c = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": Value::Null, "finish_reason": Value::Null});
        if !send(&tx, chunk(c)).await {
            return;
        }
    }
    let mut n_calls = vec![0usize; choices.len()];
    let mut lp_sent = vec![0usize; choices.len()];
    let mut cancel = st.cancel_rx();
    loop {
        let (i, events) = match merged.next(&mut choices, &mut cancel, Some(&tx)).await {
            Ok(Some(x)) => x,
            Ok(None) => break,
            Err(Interrupted::ClientGone) => return,
            Err(Interrupted::Failed(e)) => {
                let _ = send(&tx, error_chunk(&e)).await;
                return;
            }
        };
        for e in events {
            let delta = match e {
                ReplyEvent::Content(t) => json!({"content": t}),
                ReplyEvent::Reasoning(t) => json!({"reasoning_content": t}),
                ReplyEvent::ToolCall(c) => {
                    let k = n_calls[i];
                    n_calls[i] += 1;
                    json!({"tool_calls": [{
                        "index": k,
                        "id": new_id("call_"),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments_json()},
                    }]})
                }
            };
            let lp = if o.top_logprobs.is_some() && lp_sent[i] < choices[i].logprobs.len() {
                let v = chat_logprobs(&tok, &choices[i].logprobs[lp_sent[i]..]);
                lp_sent[i] = choices[i].logprobs.len();
                v
            } else {
                Value::Null
            };
            let c =
                json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": Value::Null});
            if !send(&tx, chunk(c)).await {
                return;
            }
        }
        if let Some(f) = &choices[i].finish {
            let lp = if o.top_logprobs.is_some() && lp_sent[i] < choices[i].logprobs.len() {
                chat_logprobs(&tok, &choices[i].logprobs[lp_sent[i]..])
            } else {
                Value::Null
            };
            let reason = openai_finish(f, n_calls[i] > 0);
            let c = json!({"index": i, "delta": {}, "logprobs": lp, "finish_reason": reason});
            if !send(&tx, chunk(c)).await {
                return;
            }
        }
    }
    if o.include_usage {
        let completion: usize = choices.iter().map(|c| c.usage.completion_tokens).sum();
        let c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": Value::Null,
            "choices": [],
            "usage": usage_json(n_prompt, completion, choices[0].usage.cached_tokens),
        });
        if !send(&tx, data(&c)).await {
            return;
        }
    }
    let _ = send(&tx, SseEvent::default().data("[DONE]")).await;
}

/// The prompts of a completions request: (token ids, prompt text).
fn completion_prompts(st: &AppState, v: &Value) -> ApiResult<Vec<(Vec<u32>, String)>> {
    let tok = &st.model.tokenizer;
    let from_ids = |t: Vec<u32>| -> ApiResult<(Vec<u32>, String)> {
        let text = tok
            .decode(&t, false)
            .map_err(|e| ApiError::bad_param("prompt", format!("bad token id in 'prompt': {e}")))?;
        Ok((t, text))
    };
    let from_text =
        |s: &str| -> ApiResult<(Vec<u32>, String)> { Ok((st.encode(s)?, s.to_string())) };
    match v {
        Value::String(s) => Ok(vec![from_text(s)?]),
        Value::Array(a) if a.is_empty() => {
            Err(ApiError::bad_param("prompt", "'prompt' must not be empty"))
        }
        Value::Array(a) if a.iter().all(Value::is_number) => {
            Ok(vec![from_ids(token_ids(a, "prompt")?)?])
        }
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let p = format!("prompt[{i}]");
                match x {
                    Value::String(s) => from_text(s),
                    Value::Array(t) => from_ids(token_ids(t, &p)?),
                    other => Err(ApiError::bad_param(
                        &p,
                        format!(
                            "'{p}' must be a string or an array of token ids, got {}",
                            type_name(other)
                        ),
                    )),
                }
            })
            .collect(),
        other => Err(ApiError::bad_param(
            "prompt",
            format!(
                "'prompt' must be a string, an array of strings, or an array of token ids, got {}",
                type_name(other)
            ),
        )),
    }
}

/// A completions `prompt` (text, or a list of texts) turned into fill-in-the-middle prompts
/// before `suffix`.
fn fim_prompt(pv: &Value, fmt: &crate::fim::FimFormat, suffix: &str) -> ApiResult<Value> {
    let one = |x: &Value| {
        match x {
        Value::String(p) => Ok(Value::String(fmt.prompt(p, suffix, &[], ""))),
        _ => Err(ApiError::bad_param(
            "prompt",
            "with 'suffix' (fill-in-the-middle), 'prompt' must be text (a string or a list of strings)",
        )),
    }
    };
    match pv {
        Value::Array(a) if !a.is_empty() => a
            .iter()
            .map(one)
            .collect::<ApiResult<Vec<_>>>()
            .map(Value::Array),
        x => one(x),
    }
}

/// `POST /v1/completions`.
pub async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match completions_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response_for(Api::OpenAi),
    }
}

async fn completions_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let mut o = gen_opts(&f, false, st.model.tokenizer.vocab_size())?;
    // Structured output works as in chat: every completion is constrained from its first token.
    o.constraint = response_format::parse(&f)?;
    let echo = f.bool("echo")?.unwrap_or(false);
    let mut o = o;
    let fim = match f.str("suffix")? {
        Some(s) if !s.is_empty() => {
            if echo {
                return Err(f.error("echo", "'echo' cannot be combined with 'suffix'"));
            }
            let fmt = crate::fim::format_for(&st, "suffix")?;
            o.stop.extend(fmt.stops());
            Some((fmt, s.to_string()))
        }
        _ => None,
    };
    if let Some(b) = f.int_in("best_of", 1, MAX_N)? {
        if b as usize != o.n {
            return Err(f.error("best_of", "'best_of' other than 'n' is not supported"));
        }
    }
    let pv = f.required("prompt")?;
    st.check_open()?;
    let prompts = match &fim {
        Some((fmt, suffix)) => completion_prompts(&st, &fim_prompt(pv, fmt, suffix)?)?,
        None => completion_prompts(&st, pv)?,
    };
    let mut reqs = Vec::new();
    for (ids, _) in &prompts {
        let room = st.room(ids.len(), "prompt")?;
        reqs.extend(requests(&o, ids, &[], room, COMPLETIONS_DEFAULT_MAX_TOKENS));
    }
    let n_prompt: usize = prompts.iter().map(|p| p.0.len()).sum();
    let merged = if o.constraint.is_some() {
        // Compiling the constraint (and, the first time, building the token trie) blocks.
        let st2 = st.clone();
        tokio::task::spawn_blocking(move || submit_all(&st2, reqs))
            .await
            .map_err(|e| ApiError::internal(format!("submitting the request failed: {e}")))??
    } else {
        submit_all(&st, reqs)?
    };
    let n_choices = prompts.len() * o.n;
    let choices: Vec<Choice> = (0..n_choices)
        .map(|_| Choice::new(ReplyFormat::plain(), false, None))
        .collect();
    let id = new_id("cmpl-");
    let created = unix_now();
    let echoes: Vec<String> = prompts
        .iter()
        .flat_map(|(_, t)| std::iter::repeat_n(t.clone(), o.n))
        .map(|t| if echo { t } else { String::new() })
        .collect();
    if o.stream {
        let st2 = st.clone();
        return Ok(sse_response(move |tx| {
            stream_completions(st2, merged, choices, o, echoes, id, created, n_prompt, tx)
        }));
    }
    let mut choices = choices;
    merged.collect(&st, &mut choices).await?;
    let tok = &st.model.tokenizer;
    let out: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let e = &echoes[i];
            json!({
                "index": i,
                "text": format!("{e}{}", c.raw),
                "logprobs": if o.top_logprobs.is_some() { completion_logprobs(tok, &c.logprobs, e.len()) } else { Value::Null },
                // Cannot fail: as in the chat handler, `collect` returned Ok.
                "finish_reason": openai_finish(c.finish.as_ref().expect("collected"), false),
            })
        })
        .collect();
    let completion: usize = choices.iter().map(|c| c.usage.completion_tokens).sum();
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": st.model.name,
        "system_fingerprint": Value::Null,
        "choices": out,
        "usage": usage_json(n_prompt, completion, choices[0].usage.cached_tokens),
    }))
    .into_response())
}

#[allow(clippy::too_many_arguments)]
async fn stream_completions(
    st: Arc<AppState>,
    mut merged: Merged,
    mut choices: Vec<Choice>,
    o: GenOpts,
    echoes: Vec<String>,
    id: String,
    created: u64,
    n_prompt: usize,
    tx: SseTx,
) {
    let model = st.model.name.clone();
    let tok = st.model.tokenizer.clone();
    let chunk = |choice: Value| {
        let mut c = json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": Value::Null,
            "choices": [choice],
        });
        if o.include_usage {
            c["usage"] = Value::Null;
        }
        data(&c)
    };
    for (i, e) in echoes.iter().enumerate() {
        if !e.is_empty() {
            let c = json!({"index": i, "text": e, "logprobs": Value::Null, "finish_reason": Value::Null});
            if !send(&tx, chunk(c)).await {
                return;
            }
        }
    }
    let mut offsets: Vec<usize> = echoes.iter().map(String::len).collect();
    // Raw text and logprobs of each choice sent so far.
    let mut raw_sent = vec![0usize; choices.len()];
    let mut lp_sent = vec![0usize; choices.len()];
    let mut cancel = st.cancel_rx();
    loop {
        let i = match merged.next(&mut choices, &mut cancel, Some(&tx)).await {
            Ok(Some((i, _))) => i,
            Ok(None) => break,
            Err(Interrupted::ClientGone) => return,
            Err(Interrupted::Failed(e)) => {
                let _ = send(&tx, error_chunk(&e)).await;
                return;
            }
        };
        let c = &choices[i];
        let text = &c.raw[raw_sent[i]..];
        let new_lp = &c.logprobs[lp_sent[i]..];
        raw_sent[i] = c.raw.len();
        lp_sent[i] = c.logprobs.len();
        let lp = if o.top_logprobs.is_some() && !new_lp.is_empty() {
            completion_logprobs(&tok, new_lp, offsets[i])
        } else {
            Value::Null
        };
        offsets[i] += text.len();
        let finish = c
            .finish
            .as_ref()
            .map(|f| Value::from(openai_finish(f, false)))
            .unwrap_or(Value::Null);
        if text.is_empty() && lp.is_null() && finish.is_null() {
            continue;
        }
        let ch = json!({"index": i, "text": text, "logprobs": lp, "finish_reason": finish});
        if !send(&tx, chunk(ch)).await {
            return;
        }
    }
    if o.include_usage {
        let completion: usize = choices.iter().map(|c| c.usage.completion_tokens).sum();
        let c = json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": Value::Null,
            "choices": [],
            "usage": usage_json(n_prompt, completion, choices[0].usage.cached_tokens),
        });
        if !send(&tx, data(&c)).await {
            return;
        }
    }
    let _ = send(&tx, SseEvent::default().data("[DONE]")).await;
}

fn model_json(st: &AppState, id: &str) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": st.model.created,
        "owned_by": "kapitsa",
        "max_model_len": st.engine.n_ctx(),
    })
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<Value> = st
        .model
        .names()
        .into_iter()
        .map(|n| model_json(&st, n))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`.
pub async fn model(
    State(st): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    // A model id that does not decode (invalid UTF-8 after percent-decoding) gets the API's
    // JSON error, not axum's plain-text rejection.
    let id = match id {
        Ok(Path(id)) => id,
        Err(e) => {
            return ApiError::bad(format!(
                "the model id in the URL is not valid: {}",
                e.body_text()
            ))
            .into_response_for(Api::OpenAi)
        }
    };
    match st.check_model(Some(&id)) {
        Ok(()) => Json(model_json(&st, &id)).into_response(),
        Err(e) => e.into_response_for(Api::OpenAi),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_normalised() {
        let v = json!([
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ]);
        let mut images = Images::default();
        let m = chat_messages(v.as_array().unwrap(), &mut images).unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "a\nb"}));
        assert_eq!(m[2]["content"], "");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(m[3]["tool_call_id"], "call_1");
        let bad = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]);
        let e = chat_messages(bad.as_array().unwrap(), &mut images).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        let bad = json!([{"role": "robot", "content": "x"}]);
        assert!(chat_messages(bad.as_array().unwrap(), &mut images).is_err());
        // An image part: a content list with an image item, the image collected.
        let v = json!([{"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]);
        let m = chat_messages(v.as_array().unwrap(), &mut images).unwrap();
        assert_eq!(
            m[0]["content"],
            json!([{"type": "text", "text": "see"}, {"type": "image"}])
        );
        assert_eq!(images.len(), 1);
        assert_eq!(images.parts[0].param, "messages[0].content[1]");
    }

    #[test]
    fn options_are_checked() {
        let ok = json!({"temperature": 0, "top_k": -1, "n": 2, "stop": "x", "seed": 5, "logprobs": true, "top_logprobs": 3});
        let o = gen_opts(&Fields::new(ok.as_object().unwrap()), true, 100).unwrap();
        assert_eq!(o.sampling.temperature, 0.0);
        assert_eq!(o.sampling.top_k, 0);
        assert_eq!(o.n, 2);
        assert_eq!(o.top_logprobs, Some(3));
        let b = json!({"logit_bias": {"7": -100, "99": 2.5}});
        let o = gen_opts(&Fields::new(b.as_object().unwrap()), false, 100).unwrap();
        let mut lb = o.sampling.logit_bias;
        lb.sort_by_key(|x| x.0);
        assert_eq!(lb, vec![(7, -100.0), (99, 2.5)]);
        for bad in [
            json!({"temperature": 3}),
            json!({"temperature": "hot"}),
            json!({"top_p": 1.5}),
            json!({"n": 0}),
            json!({"max_tokens": 0}),
            json!({"top_logprobs": 2}),
            json!({"repetition_penalty": 0}),
            json!({"stop": [1]}),
            json!({"logit_bias": {"100": 5}}),
            json!({"logit_bias": {"x": 5}}),
            json!({"logit_bias": {"-1": 5}}),
            json!({"logit_bias": {"1": 101}}),
            json!({"logit_bias": {"1": "5"}}),
            json!({"logit_bias": [1]}),
        ] {
            assert!(
                gen_opts(&Fields::new(bad.as_object().unwrap()), true, 100).is_err(),
                "{bad}"
            );
        }
    }
}
