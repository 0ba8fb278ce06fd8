//! OpenAI Responses API: `POST /v1/responses`, streaming or not, stateless.
//!
//! A request becomes a chat conversation for the template, as `/v1/chat/completions` does:
//!
//! | request | chat template |
//! |---|---|
//! | `instructions` | a leading `system` message |
//! | `input` string | one `user` message |
//! | item `message` (`type` optional), roles `developer` / `system` / `user` / `assistant`; content a string or `input_text` / `output_text` / `refusal` parts | that message (`developer` = `system`) |
//! | item `function_call` (`call_id`, `name`, `arguments` a JSON string), `custom_tool_call` (`input`) | a `tool_calls` entry of the assistant message (consecutive calls share one) |
//! | item `function_call_output` / `custom_tool_call_output` (`call_id`, `output`) | a `tool` message |
//! | item `reasoning` (`summary` / `content` texts) | `reasoning_content` of the next assistant message |
//! | `tools`: `function`; `namespace` (its `tools` flattened); `custom` (one string parameter `input`) | function tools |
//! | hosted tools (`web_search*`, `file_search`, `code_interpreter`, `image_generation`, `computer_use*`, `mcp`, `local_shell`) | left out: this server cannot run them |
//!
//! `tool_choice` / `parallel_tool_calls` go through [`crate::tool_choice`] (a hosted-tool
//! choice is `auto`), `text.format` through [`crate::response_format`], `reasoning.effort`
//! sets the template variables `enable_thinking` (`none` / `minimal`: off, else on) and
//! `reasoning_effort`. Nothing is stored: `store` and `include` are accepted,
//! `previous_response_id`, `conversation`, `background` and `item_reference` items are 400s.
//!
//! The reply is parsed as chat replies are ([`crate::gen::Choice`]) and returned as output
//! items: `reasoning` (the model's reasoning text as `content` `reasoning_text`, and as
//! `summary` `summary_text` when `reasoning.summary` asks for one), `message` (`output_text`),
//! `function_call` / `custom_tool_call`. Streaming events are in [`crate::responses_stream`].

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kapitsa_engine::{Constraint, ReplyFormat, SamplingParams, ToolCall};
use serde_json::{json, Map, Value};

use crate::engine::{FinishReason, Request};
use crate::error::{Api, ApiError, ApiResult};
use crate::gen::{new_id, random_u64, submit_all_for, unix_now, Choice};
use crate::images::{self, content_value, Images};
use crate::openai::{content_pieces, text_content};
use crate::params::{parse_body, type_name, Fields};
use crate::tool_choice::{self, ToolPolicy};
use crate::{body_bytes, response_format, AppState};

/// Tool types the server accepts and leaves out of the prompt (the provider runs them).
pub const HOSTED_TOOLS: [&str; 11] = [
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer_use_preview",
    "computer_use",
    "mcp",
    "local_shell",
];

/// A request read and converted.
pub(crate) struct ResponsesRequest {
    /// Chat-template messages.
    pub messages: Vec<Value>,
    /// Function tools in chat form (`None`: none).
    pub tools: Option<Value>,
    /// Names of the `custom` (free-form) tools among `tools`.
    pub custom: Vec<String>,
    /// `tool_choice`.
    pub policy: ToolPolicy,
    /// `text.format` as a constraint.
    pub format: Option<Constraint>,
    /// Template variables.
    pub extra: Option<Value>,
    /// `reasoning.summary` asks for summaries.
    pub summary: bool,
    /// Sampling.
    pub sampling: SamplingParams,
    /// `max_output_tokens`.
    pub max_tokens: Option<usize>,
    /// The `speculative` extension field.
    pub spec: kapitsa_engine::SpecRequest,
    /// `stream`.
    pub stream: bool,
    /// Request fields echoed in the response object.
    pub echo: Map<String, Value>,
    /// The images of user messages (`input_image` parts), in order.
    pub images: Images,
}

/// The text of a `reasoning` item: its `content` texts, else its `summary` texts.
fn reasoning_text(f: &Fields, p: &str) -> ApiResult<String> {
    let mut parts = Vec::new();
    for key in ["content", "summary"] {
        if let Some(a) = f.array(key)? {
            for (i, x) in a.iter().enumerate() {
                match x.get("text") {
                    Some(Value::String(t)) => parts.push(t.clone()),
                    _ => {
                        return Err(ApiError::bad_param(
                            &format!("{p}.{key}[{i}]"),
                            format!("'{p}.{key}[{i}].text' must be a string"),
                        ))
                    }
                }
            }
        }
        if !parts.is_empty() {
            break;
        }
    }
    Ok(parts.join("\n"))
}

/// The text of a tool output: a string, or content parts.
fn output_text(v: Option<&Value>, p: &str) -> ApiResult<String> {
    match v {
        None => Err(ApiError::bad_param(
            p,
            format!("'{p}' is a required property"),
        )),
        Some(v @ (Value::String(_) | Value::Array(_))) => text_content(Some(v), p),
        Some(v) => Ok(v.to_string()),
    }
}

/// Append a tool call to the assistant message at the end of `out`, or to a new one.
fn push_call(out: &mut Vec<Value>, call: Value, reasoning: &mut Option<String>) {
    if let Some(last) = out.last_mut() {
        if last["role"] == "assistant" {
            let calls = last
                .as_object_mut()
                .map(|o| o.entry("tool_calls").or_insert_with(|| json!([])));
            if let Some(Value::Array(a)) = calls {
                a.push(call);
                return;
            }
        }
    }
    let mut msg = json!({"role": "assistant", "content": "", "tool_calls": [call]});
    if let Some(r) = reasoning.take() {
        msg["reasoning_content"] = r.into();
    }
    out.push(msg);
}

/// `instructions` and `input` -> chat-template messages; the images of user messages go to
/// `images`.
fn input_messages(f: &Fields, images: &mut Images) -> ApiResult<Vec<Value>> {
    let mut out = Vec::new();
    if let Some(i) = f.str("instructions")?.filter(|s| !s.is_empty()) {
        out.push(json!({"role": "system", "content": i}));
    }
    let items = match f.required("input")? {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::bad_param("input", "'input' must not be empty"))
        }
        Value::Array(a) => a,
        v => {
            return Err(ApiError::bad_param(
                "input",
                format!(
                    "'input' must be a string or an array of items, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        let Value::Object(o) = item else {
            return Err(ApiError::bad_param(&p, format!("'{p}' must be an object")));
        };
        let prefix = format!("{p}.");
        let it = Fields::nested(o, &prefix);
        let ty = match it.str("type")? {
            Some(t) => t,
            None if it.get("role").is_some() => "message",
            None => return Err(it.error("type", format!("'{p}.type' is a required property"))),
        };
        match ty {
            "message" => {
                let role = it
                    .str("role")?
                    .ok_or_else(|| it.error("role", format!("'{p}.role' is a required property")))?;
                let cv = Some(it.required("content")?);
                let cp = format!("{p}.content");
                let content = if role == "user" {
                    content_value(content_pieces(cv, &cp, Some(&mut *images))?)
                } else {
                    Value::String(text_content(cv, &cp)?)
                };
                let role = match role {
                    "developer" | "system" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => {
                        return Err(it.error(
                            "role",
                            format!("unknown role '{other}' (expected developer, system, user or assistant)"),
                        ))
                    }
                };
                let mut msg = json!({"role": role, "content": content});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        msg["reasoning_content"] = r.into();
                    }
                }
                out.push(msg);
            }
            "function_call" | "custom_tool_call" => {
                let name = it
                    .str("name")?
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| it.error("name", format!("'{p}.name' is a required property")))?;
                let call_id = it.str("call_id")?.ok_or_else(|| {
                    it.error("call_id", format!("'{p}.call_id' is a required property"))
                })?;
                let args = if ty == "custom_tool_call" {
                    json!({"input": it.str("input")?.unwrap_or("")})
                } else {
                    match it.str("arguments")? {
                        None => json!({}),
                        Some(s) if s.trim().is_empty() => json!({}),
                        Some(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.into())),
                    }
                };
                let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}});
                push_call(&mut out, call, &mut reasoning);
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = it.str("call_id")?.ok_or_else(|| {
                    it.error("call_id", format!("'{p}.call_id' is a required property"))
                })?;
                let text = output_text(it.get("output"), &format!("{p}.output"))?;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": text}));
            }
            "reasoning" => {
                let t = reasoning_text(&it, &p)?;
                if !t.is_empty() {
                    reasoning = Some(t);
                }
            }
            "item_reference" => {
                return Err(it.error(
                    "type",
                    "'item_reference' items need stored responses, which this server does not keep: send the items themselves",
                ))
            }
            other => {
                return Err(it.error(
                    "type",
                    format!("unknown input item type '{other}' (expected message, function_call, function_call_output, custom_tool_call, custom_tool_call_output or reasoning)"),
                ))
            }
        }
    }
    Ok(out)
}

/// One function tool in chat form, from a Responses `function` tool at `p`.
fn function_tool(tf: &Fields, p: &str) -> ApiResult<Value> {
    let name = tf
        .str("name")?
        .filter(|n| !n.is_empty())
        .ok_or_else(|| tf.error("name", format!("'{p}.name' must be a non-empty string")))?;
    let mut func = Map::new();
    func.insert("name".into(), name.into());
    if let Some(d) = tf.str("description")? {
        func.insert("description".into(), d.into());
    }
    match tf.get("parameters") {
        None => {}
        Some(Value::Object(o)) => {
            func.insert("parameters".into(), Value::Object(o.clone()));
        }
        Some(_) => {
            return Err(tf.error(
                "parameters",
                format!("'{p}.parameters' must be a JSON schema object"),
            ))
        }
    }
    Ok(json!({"type": "function", "function": Value::Object(func)}))
}

/// `tools` -> (function tools in chat form, names of the custom tools).
fn tools(f: &Fields) -> ApiResult<(Vec<Value>, Vec<String>)> {
    let mut out = Vec::new();
    let mut custom = Vec::new();
    let Some(list) = f.array("tools")? else {
        return Ok((out, custom));
    };
    for (i, t) in list.iter().enumerate() {
        collect_tool(t, &format!("tools[{i}]"), &mut out, &mut custom)?;
    }
    Ok((out, custom))
}

fn collect_tool(
    t: &Value,
    p: &str,
    out: &mut Vec<Value>,
    custom: &mut Vec<String>,
) -> ApiResult<()> {
    let Value::Object(o) = t else {
        return Err(ApiError::bad_param(p, format!("'{p}' must be an object")));
    };
    let prefix = format!("{p}.");
    let tf = Fields::nested(o, &prefix);
    let ty = tf
        .str("type")?
        .ok_or_else(|| tf.error("type", format!("'{p}.type' is a required property")))?;
    match ty {
        "function" => out.push(function_tool(&tf, p)?),
        "custom" => {
            let name = tf
                .str("name")?
                .filter(|n| !n.is_empty())
                .ok_or_else(|| tf.error("name", format!("'{p}.name' must be a non-empty string")))?;
            let mut func = json!({
                "name": name,
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
            });
            if let Some(d) = tf.str("description")? {
                func["description"] = d.into();
            }
            out.push(json!({"type": "function", "function": func}));
            custom.push(name.to_string());
        }
        "namespace" => {
            let inner = tf
                .array("tools")?
                .ok_or_else(|| tf.error("tools", format!("'{p}.tools' is a required property")))?;
            for (j, t) in inner.iter().enumerate() {
                collect_tool(t, &format!("{p}.tools[{j}]"), out, custom)?;
            }
        }
        t if HOSTED_TOOLS.contains(&t) => {}
        other => {
            return Err(tf.error(
                "type",
                format!("unknown tool type '{other}' (expected function, custom, namespace or a hosted tool)"),
            ))
        }
    }
    Ok(())
}

/// `tool_choice` in the chat form [`tool_choice::openai`] reads: a hosted tool's choice is
/// `auto` (the tool is not offered), `{"type": "custom", "name"}` names a function.
fn chat_tool_choice(map: &Map<String, Value>) -> Map<String, Value> {
    let mut m = Map::new();
    if let Some(v) = map.get("parallel_tool_calls") {
        m.insert("parallel_tool_calls".into(), v.clone());
    }
    if let Some(tc) = map.get(tool_choice::PARAM) {
        let ty = tc.get("type").and_then(Value::as_str).unwrap_or("");
        let v = if HOSTED_TOOLS.contains(&ty) {
            json!("auto")
        } else if ty == "custom" {
            json!({"type": "function", "name": tc.get("name").cloned().unwrap_or(Value::Null)})
        } else {
            tc.clone()
        };
        m.insert(tool_choice::PARAM.into(), v);
    }
    m
}

/// `text.format` -> a constraint (400s name `text.format`).
fn text_format(f: &Fields) -> ApiResult<Option<Constraint>> {
    let Some(text) = f.object("text")? else {
        return Ok(None);
    };
    let Some(fmt) = Fields::nested(text, "text.").object("format")? else {
        return Ok(None);
    };
    let mut rf = Map::new();
    if let Some(t) = fmt.get("type") {
        rf.insert("type".into(), t.clone());
    }
    if fmt.get("type").and_then(Value::as_str) == Some("json_schema") {
        let mut js = Map::new();
        for k in ["name", "schema", "strict", "description"] {
            if let Some(v) = fmt.get(k) {
                js.insert(k.into(), v.clone());
            }
        }
        rf.insert("json_schema".into(), Value::Object(js));
    }
    let mut body = Map::new();
    body.insert(response_format::PARAM.into(), Value::Object(rf));
    response_format::parse(&Fields::new(&body)).map_err(|mut e| {
        e.param = Some("text.format".into());
        e.message = e
            .message
            .replace("response_format.json_schema.", "text.format.")
            .replace("response_format", "text.format");
        e
    })
}

/// `reasoning` -> (template variables, whether summaries are asked for).
fn reasoning(f: &Fields) -> ApiResult<(Option<Value>, bool)> {
    let Some(r) = f.object("reasoning")? else {
        return Ok((None, false));
    };
    let rf = Fields::nested(r, "reasoning.");
    let extra = match rf.str("effort")? {
        None => None,
        Some(e @ ("none" | "minimal")) => {
            Some(json!({"enable_thinking": false, "reasoning_effort": e}))
        }
        Some(e @ ("low" | "medium" | "high" | "xhigh")) => {
            Some(json!({"enable_thinking": true, "reasoning_effort": e}))
        }
        Some(other) => {
            return Err(rf.error(
                "effort",
                format!("unknown reasoning.effort '{other}' (expected none, minimal, low, medium, high or xhigh)"),
            ))
        }
    };
    let summary = match rf.str("summary")?.or(rf.str("generate_summary")?) {
        None | Some("none") => false,
        Some("auto" | "concise" | "detailed") => true,
        Some(other) => {
            return Err(rf.error(
                "summary",
                format!(
                "unknown reasoning.summary '{other}' (expected auto, concise, detailed or none)"
            ),
            ))
        }
    };
    Ok((extra, summary))
}

/// Read a `/v1/responses` body.
pub(crate) fn parse(map: &Map<String, Value>) -> ApiResult<ResponsesRequest> {
    let f = Fields::new(map);
    for key in ["previous_response_id", "conversation"] {
        if f.get(key).is_some() {
            return Err(f.error(
                key,
                format!("'{key}' is not supported: this server is stateless and keeps no responses; send the whole conversation in 'input' (as with store: false)"),
            ));
        }
    }
    if f.bool("background")?.unwrap_or(false) {
        return Err(f.error("background", "background responses are not supported"));
    }
    f.bool("store")?;
    f.strings("include", 64)?;
    let mut images = Images::default();
    let messages = input_messages(&f, &mut images)?;
    let (tool_list, custom) = tools(&f)?;
    let tools = (!tool_list.is_empty()).then(|| Value::Array(tool_list));
    let tc = chat_tool_choice(map);
    let policy = tool_choice::openai(&Fields::new(&tc), tools.as_ref())?;
    let format = text_format(&f)?;
    let (mut extra, summary) = reasoning(&f)?;
    if format.is_some() || policy.choice.forces_call() {
        response_format::no_thinking(&mut extra);
    }
    let mut s = SamplingParams::default();
    if let Some(t) = f.f32_in("temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = f.f32_in("top_p", 0.0, 1.0)? {
        s.top_p = p.max(1e-6);
    }
    s.seed = random_u64();
    s.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let max_tokens = f
        .int_in("max_output_tokens", 1, i64::from(u32::MAX))?
        .map(|m| m as usize);
    let stream = f.bool("stream")?.unwrap_or(false);
    let mut echo = Map::new();
    let defaults = [
        ("instructions", Value::Null),
        ("tools", json!([])),
        ("tool_choice", json!("auto")),
        ("parallel_tool_calls", json!(true)),
        ("temperature", Value::Null),
        ("top_p", Value::Null),
        ("max_output_tokens", Value::Null),
        ("metadata", json!({})),
        ("store", json!(false)),
        ("truncation", json!("disabled")),
        ("user", Value::Null),
    ];
    for (k, d) in defaults {
        echo.insert(k.into(), f.get(k).cloned().unwrap_or(d));
    }
    let r = f.object("reasoning")?;
    echo.insert(
        "reasoning".into(),
        json!({
            "effort": r.and_then(|r| r.get("effort")).cloned().unwrap_or(Value::Null),
            "summary": r.and_then(|r| r.get("summary")).cloned().unwrap_or(Value::Null),
        }),
    );
    let fmt = f
        .object("text")?
        .and_then(|t| t.get("format"))
        .cloned()
        .unwrap_or_else(|| json!({"type": "text"}));
    echo.insert("text".into(), json!({"format": fmt}));
    Ok(ResponsesRequest {
        messages,
        tools,
        custom,
        policy,
        format,
        extra,
        summary,
        sampling: s,
        max_tokens,
        spec: crate::params::spec_field(&f)?,
        stream,
        echo,
        images,
    })
}

/// `POST /v1/responses`.
pub async fn responses(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match responses_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response_for(Api::OpenAi),
    }
}

/// What the output items of a reply need besides the reply.
pub(crate) struct ReplyShape {
    /// Names of the custom tools (their calls are `custom_tool_call` items).
    pub custom: Vec<String>,
    /// Reasoning is also given as a summary.
    pub summary: bool,
}

impl ReplyShape {
    /// The `reasoning` output item.
    pub fn reasoning_item(&self, id: &str, text: &str) -> Value {
        let summary = if self.summary {
            json!([{"type": "summary_text", "text": text}])
        } else {
            json!([])
        };
        json!({
            "type": "reasoning",
            "id": id,
            "summary": summary,
            "content": [{"type": "reasoning_text", "text": text}],
        })
    }

    /// The `message` output item.
    pub fn message_item(id: &str, text: &str, status: &str) -> Value {
        json!({
            "type": "message",
            "id": id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        })
    }

    /// The `function_call` or `custom_tool_call` output item of a call.
    pub fn call_item(&self, call: &ToolCall) -> Value {
        if self.custom.contains(&call.name) {
            let input = match call.arguments.get("input") {
                Some(Value::String(s)) => s.clone(),
                _ => call.arguments_json(),
            };
            json!({
                "type": "custom_tool_call",
                "id": new_id("ctc_"),
                "call_id": new_id("call_"),
                "name": call.name,
                "input": input,
                "status": "completed",
            })
        } else {
            json!({
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": new_id("call_"),
                "name": call.name,
                "arguments": call.arguments_json(),
                "status": "completed",
            })
        }
    }
}

/// The response object.
pub(crate) struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    /// `created_at`.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// Request fields echoed back.
    pub echo: Map<String, Value>,
    /// Prompt tokens.
    pub n_prompt: usize,
}

impl ResponseObject {
    /// The object with `status`, `output` and, when finished, `usage` (`choice`).
    pub fn render(
        &self,
        status: &str,
        output: Vec<Value>,
        finished: Option<(&Choice, usize)>,
    ) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": Value::Null,
            "incomplete_details": Value::Null,
            "model": self.model,
            "output": output,
            "previous_response_id": Value::Null,
            "usage": Value::Null,
        });
        if let Value::Object(o) = &mut v {
            for (k, x) in &self.echo {
                o.insert(k.clone(), x.clone());
            }
        }
        if let Some((c, reasoning_tokens)) = finished {
            let out = c.usage.completion_tokens;
            v["usage"] = json!({
                "input_tokens": self.n_prompt,
                "input_tokens_details": {"cached_tokens": c.usage.cached_tokens},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens.min(out)},
                "total_tokens": self.n_prompt + out,
            });
            if status == "incomplete" {
                v["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
        }
        v
    }
}

/// `completed`, or `incomplete` for a reply cut by the token limit or the context.
pub(crate) fn status(f: &FinishReason) -> &'static str {
    match f {
        FinishReason::Length | FinishReason::ContextFull => "incomplete",
        FinishReason::EndOfGeneration | FinishReason::StopString => "completed",
    }
}

/// Tokens of a reasoning text (for `output_tokens_details.reasoning_tokens`).
pub(crate) fn count_tokens(st: &AppState, text: &str) -> usize {
    if text.is_empty() {
        return 0;
    }
    st.model
        .tokenizer
        .encode(text, false, false)
        .map_or(0, |t| t.len())
}

async fn responses_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    st.check_model(f.str("model")?)?;
    let mut r = parse(&map)?;
    r.images.check(&st)?;
    st.check_open()?;
    let prompt_tools = r.policy.prompt_tools(r.tools.as_ref());
    let text = st.render(r.messages.clone(), prompt_tools, r.extra.as_ref())?;
    let prompt = st.encode(&text)?;
    let prepared = images::prepare(&st, std::mem::take(&mut r.images), &prompt).await?;
    let room = st.room(prepared.n_prompt, "input")?;
    let model_fmt = st.model.reply_format;
    let tool_constraint = if r.format.is_none() || r.policy.choice.forces_call() {
        tool_choice::constraint(&r.policy, r.tools.as_ref(), model_fmt, &text)?
    } else {
        None
    };
    let (fmt, param) = match (&tool_constraint, &r.format) {
        (Some(_), _) => (model_fmt, tool_choice::PARAM),
        (None, Some(_)) => (ReplyFormat::plain(), "text.format"),
        (None, None) => (model_fmt, response_format::PARAM),
    };
    let constraint = tool_constraint.or(r.format.clone());
    let req = Request {
        prompt: prompt.clone(),
        sampling: r.sampling.clone(),
        max_tokens: r.max_tokens.unwrap_or(room).min(room).max(1),
        stop: Vec::new(),
        ignore_eos: false,
        top_logprobs: None,
        constraint,
        spec: r.spec,
        images: prepared.inputs,
    };
    let merged = if req.constraint.is_some() {
        let st2 = st.clone();
        let param = param.to_string();
        tokio::task::spawn_blocking(move || submit_all_for(&st2, vec![req], &param))
            .await
            .map_err(|e| ApiError::internal(format!("submitting the request failed: {e}")))??
    } else {
        submit_all_for(&st, vec![req], param)?
    };
    let choice = Choice::new(fmt, fmt.starts_in_reasoning(&text), prompt_tools);
    let obj = ResponseObject {
        id: new_id("resp_"),
        created: unix_now(),
        model: st.model.name.clone(),
        echo: r.echo,
        n_prompt: prepared.n_prompt,
    };
    let shape = ReplyShape {
        custom: r.custom,
        summary: r.summary,
    };
    if r.stream {
        let st2 = st.clone();
        return Ok(crate::gen::sse_response(move |tx| {
            crate::responses_stream::stream(st2, merged, choice, obj, shape, tx)
        }));
    }
    let mut c = choice;
    merged.collect(&st, std::slice::from_mut(&mut c)).await?;
    let finish = c
        .finish
        .clone()
        .ok_or_else(|| ApiError::internal("the reply has no end"))?;
    let reply = &c.reply;
    let mut output = Vec::new();
    let mut n_reasoning = 0;
    if let Some(th) = reply.reasoning.as_ref().filter(|t| !t.is_empty()) {
        output.push(shape.reasoning_item(&new_id("rs_"), th));
        n_reasoning = count_tokens(&st, th);
    }
    if !reply.content.is_empty() || reply.tool_calls.is_empty() {
        output.push(ReplyShape::message_item(
            &new_id("msg_"),
            &reply.content,
            "completed",
        ));
    }
    for t in &reply.tool_calls {
        output.push(shape.call_item(t));
    }
    let v = obj.render(status(&finish), output, Some((&c, n_reasoning)));
    Ok(Json(v).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(v: Value) -> ApiResult<ResponsesRequest> {
        parse(v.as_object().unwrap())
    }

    /// Codex CLI's request shape.
    #[test]
    fn codex_shape() {
        let r = parsed(json!({
            "model": "gpt-5-codex",
            "instructions": "You are Codex.",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: read-only"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "run ls"}], "encrypted_content": "xx"},
                {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"command\": [\"ls\"]}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\n"},
                {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
                {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
            ],
            "tools": [
                {"type": "function", "name": "shell", "description": "Run", "strict": false, "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}},
                {"type": "custom", "name": "apply_patch", "description": "Patch", "format": {"type": "grammar"}},
                {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "mcp__fs__read", "parameters": {"type": "object"}}]},
                {"type": "web_search"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": false,
            "stream": true,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc",
        }))
        .unwrap();
        let m = &r.messages;
        assert_eq!(m[0], json!({"role": "system", "content": "You are Codex."}));
        assert_eq!(
            m[1],
            json!({"role": "system", "content": "sandbox: read-only"})
        );
        assert_eq!(m[2], json!({"role": "user", "content": "list files"}));
        assert_eq!(m[3]["role"], "assistant");
        assert_eq!(m[3]["reasoning_content"], "run ls");
        assert_eq!(
            m[3]["tool_calls"][0]["function"]["arguments"],
            json!({"command": ["ls"]})
        );
        assert_eq!(m[3]["tool_calls"][0]["id"], "call_1");
        assert_eq!(
            m[4],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "a.txt\n"})
        );
        assert_eq!(
            m[5]["tool_calls"][0]["function"]["arguments"],
            json!({"input": "*** Begin Patch"})
        );
        let names: Vec<&str> = r
            .tools
            .as_ref()
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["shell", "apply_patch", "mcp__fs__read"]);
        assert_eq!(r.custom, ["apply_patch"]);
        assert!(r.summary && r.stream && r.policy.single);
        assert_eq!(r.extra.unwrap()["enable_thinking"], true);
    }

    #[test]
    fn formats_and_errors() {
        let r = parsed(json!({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": true}}})).unwrap();
        assert_eq!(
            r.format,
            Some(Constraint::JsonSchema(json!({"type": "object"})))
        );
        let r = parsed(json!({"model": "m", "input": "hi", "tool_choice": {"type": "web_search_preview"}, "tools": [{"type": "web_search_preview"}]})).unwrap();
        assert!(r.tools.is_none());
        for (bad, param) in [
            (
                json!({"input": "hi", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": 5}), "input"),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "input[0].type",
            ),
            (json!({"input": [{"type": "hologram"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "robot", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0]",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "input[0].output",
            ),
            (
                json!({"input": "hi", "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
            (
                json!({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}),
                "tools[0].parameters",
            ),
            (
                json!({"input": "hi", "tools": [{"type": "teleport"}]}),
                "tools[0].type",
            ),
            (
                json!({"input": "hi", "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"input": "hi", "text": {"format": {"type": "yaml"}}}),
                "text.format",
            ),
            (
                json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}),
                "text.format",
            ),
            (
                json!({"input": "hi", "reasoning": {"effort": "extreme"}}),
                "reasoning.effort",
            ),
            (json!({"input": "hi", "temperature": 3}), "temperature"),
            (
                json!({"input": "hi", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
        ] {
            let e = match parsed(bad.clone()) {
                Err(e) => e,
                Ok(_) => panic!("accepted: {bad}"),
            };
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {e:?}");
        }
    }
}
