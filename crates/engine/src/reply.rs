//! Splitting a model's reply into reasoning, visible content and tool calls, as it streams.
//!
//! The chat templates of the model families we serve define the markup; [`ReplyFormat`] says
//! which markup to look for (detect it from the template text with
//! [`ReplyFormat::from_template`]):
//!
//! | family | reasoning | tool call |
//! |---|---|---|
//! | Qwen2.5 | none | `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>` ([`ToolCallFormat::Json`]) |
//! | Qwen3 | `<think>\n...\n</think>\n\n` at the start of the reply | as Qwen2.5 |
//! | Qwen3.5 / 3.6 | the generation prompt ends with `<think>\n` (thinking on) or `<think>\n\n</think>\n\n` (off) | `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>` ([`ToolCallFormat::XmlFunction`]) |
//! | Nemotron 3 | the generation prompt ends with `<think>\n` (on) or `<think></think>` (off) | as Qwen3.5 |
//!
//! [`ReplyParser`] takes the generated text in pieces of any size and returns [`ReplyEvent`]s
//! as soon as they are decided: text that might be the start of a tag (`<thi`, `</tool_`) is
//! held back until the next piece settles it, as [`crate::StopChecker`] does for stop strings,
//! and a tool call is reported whole once its closing tag arrives. The result never depends on
//! how the text was split.
//!
//! Rules (the same whatever the split):
//! - `<think>` opens the reasoning block only at the very start of the reply (after optional
//!   whitespace), or implicitly when the prompt already opened it (`starts_in_reasoning`, see
//!   [`ReplyFormat::starts_in_reasoning`]); `</think>` closes it. Inside reasoning, tool-call
//!   markup is plain reasoning text. A reasoning block that never closes (the reply was cut
//!   off) stays reasoning.
//! - Reasoning and content are trimmed of leading and trailing whitespace, as the templates
//!   do when they re-render a message (the whitespace around `</think>` and before a tool call
//!   is template markup, not text). Trailing whitespace is held back while streaming and only
//!   released when more text follows.
//! - `<tool_call>` is recognised anywhere in the content, including inside a Markdown code
//!   block: the parser does not track Markdown, and neither do the reference parsers (llama.cpp,
//!   vLLM); a code block that quotes a *well-formed* tool call is therefore reported as a call,
//!   while a quoted fragment that does not parse stays content.
//! - A tool call whose body does not parse, one that is never closed, and one interrupted by a
//!   new `<tool_call>` are returned as content, markup included: text is never lost.
//! - Content between or after tool calls is kept (joined, with the markup removed).
//! - With a format that has neither reasoning nor tool calls ([`ReplyFormat::plain`]) the text
//!   passes through unchanged (no trimming).
//!
//! [`ParsedReply::to_message`] turns the result back into the assistant message the templates
//! expect in the history, so that the template keeps or drops the reasoning as designed. For the
//! four templates above, rendering that message re-creates the model's raw output byte for byte
//! when the model followed the template's own formatting (tested in `tests/reply.rs`).

use serde_json::{Map, Value};

/// Opening tag of a reasoning block.
pub const THINK_OPEN: &str = "<think>";
/// Closing tag of a reasoning block.
pub const THINK_CLOSE: &str = "</think>";
/// Opening tag of a tool call.
pub const TOOL_OPEN: &str = "<tool_call>";
/// Closing tag of a tool call.
pub const TOOL_CLOSE: &str = "</tool_call>";

/// How the body of a `<tool_call>...</tool_call>` block is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `{"name": NAME, "arguments": {...}}` (Qwen2.5, Qwen3). `"parameters"` is accepted for
    /// `"arguments"`, and arguments given as a string holding a JSON object are decoded.
    Json,
    /// `<function=NAME>` then `<parameter=ARG>\nVALUE\n</parameter>` blocks, then `</function>`
    /// (Qwen3.5/3.6, Nemotron 3). One newline after `<parameter=ARG>` and one before
    /// `</parameter>` belong to the markup. Values that parse as JSON (numbers, booleans,
    /// objects, arrays, `null`, quoted strings) become that JSON value, anything else is kept
    /// as a string; tool schemas given with [`ReplyParser::with_tools`] refine this.
    XmlFunction,
}

/// The markup a model's replies use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplyFormat {
    /// Replies may carry a `<think>...</think>` reasoning block.
    pub reasoning: bool,
    /// How tool calls are written; `None`: the model has no known tool-call syntax and
    /// `<tool_call>` is ordinary text.
    pub tool_calls: Option<ToolCallFormat>,
}

impl ReplyFormat {
    /// No reasoning, no tool calls: the parser passes text through unchanged.
    pub fn plain() -> ReplyFormat {
        ReplyFormat::default()
    }

    /// Detect the format from the source text of a chat template: reasoning when it mentions
    /// `<think>`; [`ToolCallFormat::XmlFunction`] when it writes `<tool_call>` and
    /// `<function=`, [`ToolCallFormat::Json`] when it writes `<tool_call>` only.
    pub fn from_template(template_src: &str) -> ReplyFormat {
        let reasoning = template_src.contains(THINK_OPEN);
        let tool_calls = if !template_src.contains(TOOL_OPEN) {
            None
        } else if template_src.contains("<function=") {
            Some(ToolCallFormat::XmlFunction)
        } else {
            Some(ToolCallFormat::Json)
        };
        ReplyFormat {
            reasoning,
            tool_calls,
        }
    }

    /// Whether a reply to `rendered_prompt` starts inside the reasoning block: the format has
    /// reasoning and the prompt ends (ignoring whitespace) with an opening `<think>`, as the
    /// Qwen3.5 and Nemotron 3 generation prompts do with thinking on.
    pub fn starts_in_reasoning(&self, rendered_prompt: &str) -> bool {
        self.reasoning && rendered_prompt.trim_end().ends_with(THINK_OPEN)
    }
}

/// One tool call of a reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Function name.
    pub name: String,
    /// Arguments: always a JSON object.
    pub arguments: Value,
}

impl ToolCall {
    /// The arguments as a compact JSON string (the OpenAI API's `function.arguments`).
    pub fn arguments_json(&self) -> String {
        self.arguments.to_string()
    }
}

/// A complete reply, split up.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedReply {
    /// The reasoning text; `Some` (possibly empty) when the reply had a reasoning block.
    pub reasoning: Option<String>,
    /// The visible answer.
    pub content: String,
    /// Tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedReply {
    /// The assistant message for the chat history:
    /// `{"role": "assistant", "content": "...", "reasoning_content": "...", "tool_calls":
    /// [{"type": "function", "function": {"name": "...", "arguments": {...}}}]}`.
    ///
    /// `content` is always a string (Qwen3's template fails on a missing one);
    /// `reasoning_content` is present when [`ParsedReply::reasoning`] is `Some`; `tool_calls`
    /// when there are any. `arguments` is an object, not the OpenAI wire format's JSON string:
    /// Qwen2.5's template passes it through `tojson` and the Qwen3.5 and Nemotron templates
    /// iterate over its items, so only an object renders correctly in all of them. Callers that
    /// need ids (OpenAI `id` / `tool_call_id`) add them to the entries.
    pub fn to_message(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), "assistant".into());
        m.insert("content".into(), self.content.clone().into());
        if let Some(r) = &self.reasoning {
            m.insert("reasoning_content".into(), r.clone().into());
        }
        if !self.tool_calls.is_empty() {
            let calls = self
                .tool_calls
                .iter()
                .map(|c| {
                    serde_json::json!({
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    })
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        Value::Object(m)
    }
}

/// A decided piece of a streaming reply.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyEvent {
    /// More reasoning text.
    Reasoning(String),
    /// More visible content.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

/// A text channel that drops leading and trailing whitespace: trailing whitespace is held
/// until non-whitespace text follows it.
#[derive(Debug, Clone, Default)]
struct Trimmed {
    started: bool,
    ws: String,
    all: String,
}

impl Trimmed {
    /// Add `s`; returns the text that can be emitted now.
    fn feed(&mut self, s: &str) -> String {
        let s = if self.started { s } else { s.trim_start() };
        if s.is_empty() {
            return String::new();
        }
        self.started = true;
        let keep = s.trim_end().len();
        if keep == 0 {
            self.ws.push_str(s);
            return String::new();
        }
        let mut out = std::mem::take(&mut self.ws);
        out.push_str(&s[..keep]);
        self.ws.push_str(&s[keep..]);
        self.all.push_str(&out);
        out
    }

    /// Add `s` unchanged (plain format).
    fn feed_raw(&mut self, s: &str) -> String {
        self.started |= !s.is_empty();
        self.all.push_str(s);
        s.to_string()
    }
}

/// Parameter types of the known tools, for [`ToolCallFormat::XmlFunction`] values.
#[derive(Debug, Clone, Default)]
struct ToolSchemas {
    /// (function name, parameter name, JSON-schema `type`).
    types: Vec<(String, String, String)>,
}

impl ToolSchemas {
    fn from_tools(tools: &Value) -> ToolSchemas {
        let mut types = Vec::new();
        for t in tools.as_array().into_iter().flatten() {
            let f = t.get("function").unwrap_or(t);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let props = f
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object);
            for (p, schema) in props.into_iter().flatten() {
                // `"type": "string"` or `"type": ["string", "null"]`.
                let ty = match schema.get("type") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Array(a)) => {
                        let non_null: Vec<&str> = a
                            .iter()
                            .filter_map(Value::as_str)
                            .filter(|s| *s != "null")
                            .collect();
                        match non_null.as_slice() {
                            [one] => Some(one.to_string()),
                            _ => None,
                        }
                    }
                    _ => None,
                };
                if let Some(ty) = ty {
                    types.push((name.to_string(), p.clone(), ty));
                }
            }
        }
        ToolSchemas { types }
    }

    fn param_type(&self, func: &str, param: &str) -> Option<&str> {
        self.types
            .iter()
            .find(|(f, p, _)| f == func && p == param)
            .map(|(_, _, t)| t.as_str())
    }
}

/// Streaming reply parser; see the [module documentation](self) for the rules.
///
/// ```
/// use kapitsa_engine::reply::{ReplyEvent, ReplyFormat, ReplyParser, ToolCallFormat};
/// let fmt = ReplyFormat { reasoning: true, tool_calls: Some(ToolCallFormat::Json) };
/// let mut p = ReplyParser::new(fmt, false);
/// let mut events = p.push("<think>\nhmm\n</th");
/// events.extend(p.push("ink>\n\nSure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"));
/// let (rest, reply) = p.finish();
/// assert!(rest.is_empty());
/// assert_eq!(events[0], ReplyEvent::Reasoning("hmm".into()));
/// assert_eq!(events[1], ReplyEvent::Content("Sure.".into()));
/// assert!(matches!(&events[2], ReplyEvent::ToolCall(c) if c.name == "f"));
/// assert_eq!(reply.reasoning.as_deref(), Some("hmm"));
/// assert_eq!(reply.content, "Sure.");
/// ```
#[derive(Debug, Clone)]
pub struct ReplyParser {
    fmt: ReplyFormat,
    mode: Mode,
    /// Undecided text (in `Mode::ToolCall`: the tool call body so far).
    buf: String,
    /// A `<think>` may still open the reasoning block.
    think_allowed: bool,
    reasoning: Option<Trimmed>,
    content: Trimmed,
    tool_calls: Vec<ToolCall>,
    schemas: ToolSchemas,
}

impl ReplyParser {
    /// A parser for replies in `fmt`. `starts_in_reasoning`: the prompt already opened the
    /// reasoning block (see [`ReplyFormat::starts_in_reasoning`]); ignored without reasoning.
    pub fn new(fmt: ReplyFormat, starts_in_reasoning: bool) -> Self {
        let in_reasoning = fmt.reasoning && starts_in_reasoning;
        ReplyParser {
            fmt,
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            think_allowed: fmt.reasoning && !in_reasoning,
            reasoning: in_reasoning.then(Trimmed::default),
            content: Trimmed::default(),
            tool_calls: Vec::new(),
            schemas: ToolSchemas::default(),
        }
    }

    /// Use the parameter types of `tools` (an array of OpenAI tool definitions,
    /// `{"type": "function", "function": {"name", "parameters": {"properties": ...}}}`, or the
    /// bare function objects) to type [`ToolCallFormat::XmlFunction`] values: a `"string"`
    /// parameter keeps its text even when it looks like JSON (`"007"`, `"true"`); a `"boolean"`
    /// one also accepts `True` / `False` (how the Qwen3.5 and Nemotron templates print
    /// booleans). Other types, unknown tools and untyped parameters use the default rule.
    pub fn with_tools(mut self, tools: &Value) -> Self {
        self.schemas = ToolSchemas::from_tools(tools);
        self
    }

    fn is_plain(&self) -> bool {
        !self.fmt.reasoning && self.fmt.tool_calls.is_none()
    }

    fn emit_content(&mut self, s: &str, out: &mut Vec<ReplyEvent>) {
        let t = if self.is_plain() {
            self.content.feed_raw(s)
        } else {
            self.content.feed(s)
        };
        if !t.is_empty() {
            out.push(ReplyEvent::Content(t));
        }
    }

    fn emit_reasoning(&mut self, s: &str, out: &mut Vec<ReplyEvent>) {
        let t = self.reasoning.get_or_insert_with(Trimmed::default).feed(s);
        if !t.is_empty() {
            out.push(ReplyEvent::Reasoning(t));
        }
    }

    /// Feed the next piece of generated text; returns the events it decides.
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        self.buf.push_str(text);
        self.process(&mut out);
        out
    }

    fn process(&mut self, out: &mut Vec<ReplyEvent>) {
        loop {
            match self.mode {
                Mode::Content => {
                    if self.think_allowed {
                        let t = self.buf.trim_start();
                        if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                            self.buf = rest.to_string();
                            self.think_allowed = false;
                            self.reasoning = Some(Trimmed::default());
                            self.mode = Mode::Reasoning;
                            continue;
                        }
                        if THINK_OPEN.starts_with(t) {
                            // Only whitespace and perhaps the start of `<think>` so far.
                            return;
                        }
                        self.think_allowed = false;
                    }
                    if self.fmt.tool_calls.is_none() {
                        let s = std::mem::take(&mut self.buf);
                        self.emit_content(&s, out);
                        return;
                    }
                    if let Some(at) = self.buf.find(TOOL_OPEN) {
                        let before = self.buf[..at].to_string();
                        self.buf.drain(..at + TOOL_OPEN.len());
                        self.emit_content(&before, out);
                        self.mode = Mode::ToolCall;
                        continue;
                    }
                    let cut = self.buf.len() - partial_suffix(&self.buf, TOOL_OPEN);
                    let s: String = self.buf.drain(..cut).collect();
                    self.emit_content(&s, out);
                    return;
                }
                Mode::Reasoning => {
                    if let Some(at) = self.buf.find(THINK_CLOSE) {
                        let before = self.buf[..at].to_string();
                        self.buf.drain(..at + THINK_CLOSE.len());
                        self.emit_reasoning(&before, out);
                        if let Some(r) = &mut self.reasoning {
                            r.ws.clear();
                        }
                        self.mode = Mode::Content;
                        continue;
                    }
                    let cut = self.buf.len() - partial_suffix(&self.buf, THINK_CLOSE);
                    let s: String = self.buf.drain(..cut).collect();
                    self.emit_reasoning(&s, out);
                    return;
                }
                Mode::ToolCall => {
                    let close = self.buf.find(TOOL_CLOSE);
                    let reopen = self.buf.find(TOOL_OPEN);
                    match (close, reopen) {
                        (Some(c), r) if r.is_none_or(|r| c < r) => {
                            let body = self.buf[..c].to_string();
                            self.buf.drain(..c + TOOL_CLOSE.len());
                            self.mode = Mode::Content;
                            match self.parse_call(&body) {
                                Some(call) => {
                                    self.tool_calls.push(call.clone());
                                    out.push(ReplyEvent::ToolCall(call));
                                }
                                None => {
                                    let raw = format!("{TOOL_OPEN}{body}{TOOL_CLOSE}");
                                    self.emit_content(&raw, out);
                                }
                            }
                        }
                        (_, Some(r)) => {
                            // A new `<tool_call>` before this one closed: this one is text.
                            let raw = format!("{TOOL_OPEN}{}", &self.buf[..r]);
                            self.buf.drain(..r + TOOL_OPEN.len());
                            self.emit_content(&raw, out);
                        }
                        // Neither tag is complete yet.
                        _ => return,
                    }
                }
            }
        }
    }

    fn parse_call(&self, body: &str) -> Option<ToolCall> {
        match self.fmt.tool_calls? {
            ToolCallFormat::Json => parse_json_call(body),
            ToolCallFormat::XmlFunction => parse_xml_call(body, &self.schemas),
        }
    }

    /// End of the reply: release held-back text and return the last events and the whole
    /// parsed reply. The concatenated text of all events equals the reply's `reasoning` and
    /// `content`, and the `ToolCall` events are its `tool_calls`.
    pub fn finish(mut self) -> (Vec<ReplyEvent>, ParsedReply) {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match self.mode {
            Mode::Content => self.emit_content(&rest, &mut out),
            Mode::Reasoning => self.emit_reasoning(&rest, &mut out),
            Mode::ToolCall => {
                let raw = format!("{TOOL_OPEN}{rest}");
                self.emit_content(&raw, &mut out);
            }
        }
        let reply = ParsedReply {
            reasoning: self.reasoning.map(|r| r.all),
            content: self.content.all,
            tool_calls: self.tool_calls,
        };
        (out, reply)
    }
}

/// Parse a whole reply at once.
pub fn parse_reply(fmt: ReplyFormat, starts_in_reasoning: bool, text: &str) -> ParsedReply {
    let mut p = ReplyParser::new(fmt, starts_in_reasoning);
    p.push(text);
    p.finish().1
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag` (ASCII).
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&i| s.ends_with(&tag[..i]))
        .unwrap_or(0)
}

/// `{"name": ..., "arguments": {...}}`.
fn parse_json_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(a @ Value::Object(_)) => a,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// `<function=NAME>` (`<parameter=ARG>\nVALUE\n</parameter>`)* `</function>`.
fn parse_xml_call(body: &str, schemas: &ToolSchemas) -> Option<ToolCall> {
    let s = body.trim().strip_prefix("<function=")?;
    let gt = s.find('>')?;
    let name = s[..gt].trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return None;
    }
    let mut rest = s[gt + 1..].strip_suffix("</function>")?;
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let p = rest.strip_prefix("<parameter=")?;
        let gt = p.find('>')?;
        let pname = p[..gt].trim();
        if pname.is_empty() || pname.contains(['<', '\n']) {
            return None;
        }
        let after = &p[gt + 1..];
        // The closing tag is the first `</parameter>` followed by another parameter or the
        // end, so a value may itself contain the text `</parameter>`.
        let mut end = None;
        let mut from = 0;
        while let Some(i) = after[from..].find("</parameter>") {
            let at = from + i;
            let tail = after[at + "</parameter>".len()..].trim_start();
            if tail.is_empty() || tail.starts_with("<parameter=") {
                end = Some(at);
                break;
            }
            from = at + 1;
        }
        let end = end?;
        let raw = &after[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        args.insert(
            pname.to_string(),
            xml_value(raw, schemas.param_type(name, pname)),
        );
        rest = &after[end + "</parameter>".len()..];
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(args),
    })
}

/// The JSON value of an XML parameter's text, given the schema type if known.
fn xml_value(raw: &str, ty: Option<&str>) -> Value {
    match ty {
        Some("string") => return Value::String(raw.to_string()),
        Some("boolean") => match raw.trim() {
            "true" | "True" => return Value::Bool(true),
            "false" | "False" => return Value::Bool(false),
            _ => {}
        },
        _ => {}
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("abc<tool", TOOL_OPEN), 5);
        assert_eq!(partial_suffix("abc<", TOOL_OPEN), 1);
        assert_eq!(partial_suffix("abc", TOOL_OPEN), 0);
        assert_eq!(partial_suffix("<tool_call>", TOOL_OPEN), 0);
        assert_eq!(partial_suffix("é</", THINK_CLOSE), 2);
    }

    #[test]
    fn trimmed_holds_trailing_whitespace() {
        let mut t = Trimmed::default();
        assert_eq!(t.feed("  \n"), "");
        assert_eq!(t.feed(" a b "), "a b");
        assert_eq!(t.feed("\n"), "");
        assert_eq!(t.feed("c"), " \nc");
        assert_eq!(t.all, "a b \nc");
    }

    #[test]
    fn xml_values() {
        assert_eq!(xml_value("2", None), serde_json::json!(2));
        assert_eq!(xml_value("True", None), serde_json::json!("True"));
        assert_eq!(xml_value("True", Some("boolean")), serde_json::json!(true));
        assert_eq!(xml_value("007", Some("string")), serde_json::json!("007"));
        assert_eq!(xml_value("a b", None), serde_json::json!("a b"));
        assert_eq!(xml_value("[1, 2]", None), serde_json::json!([1, 2]));
    }
}
