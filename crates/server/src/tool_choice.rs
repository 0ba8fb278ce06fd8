//! `tool_choice` (OpenAI and Anthropic) -> a constraint on the reply, enforced by constrained
//! decoding (`kapitsa_engine::structured`, llguidance's Lark grammars).
//!
//! | OpenAI | Anthropic | the reply |
//! |---|---|---|
//! | absent, `"auto"` | absent, `{"type": "auto"}` | unconstrained: text and / or tool calls |
//! | `"none"` | `{"type": "none"}` | tools hidden from the prompt, and the text may not contain the tool-call opening tag `<tool_call>` |
//! | `"required"` | `{"type": "any"}` | one or more tool calls and nothing else (exactly one with `parallel_tool_calls: false` / `disable_parallel_tool_use: true`) |
//! | `{"type": "function", "function": {"name": N}}` | `{"type": "tool", "name": N}` | exactly one call of `N` and nothing else |
//!
//! **Grammars in the model's own markup.** A forced call is written in the family's tool-call
//! format ([`ToolCallFormat`], detected from the chat template as for the reply parser), byte
//! for byte as the chat template renders a call in the history:
//!
//! - [`ToolCallFormat::Json`] (Qwen2.5, Qwen3): `<tool_call>\n{"name": "N", "arguments": ARGS}\n</tool_call>`,
//!   calls separated by `\n`; `ARGS` is JSON valid under the tool's `parameters` schema
//!   (`%json`, with the bounded whitespace of `response_format`).
//! - [`ToolCallFormat::XmlFunction`] (Qwen3.5 / 3.6, Nemotron 3):
//!   `<tool_call>\n<function=N>\n` then `<parameter=P>\nVALUE\n</parameter>\n` per parameter
//!   (required ones always, optional ones may be left out, in the schema's `properties`
//!   order), then `</function>\n</tool_call>`. `VALUE` follows the reply parser's typing:
//!   a `"string"` parameter is raw text (its `enum` / `const`, `minLength` / `maxLength` and
//!   `pattern` enforced; `format` is not), a `"boolean"` one `true` / `false` / `True` /
//!   `False`, anything else JSON valid under the parameter's schema. Top-level schema
//!   keywords this form cannot express (`anyOf`, `minProperties`, `patternProperties`, ...)
//!   and names containing `<`, `>` or line breaks are refused (400).
//!
//! The reply therefore goes through the same `ReplyParser` as an unconstrained one (streamed
//! `tool_calls` deltas, `finish_reason: "tool_calls"` / `stop_reason: "tool_use"`).
//!
//! **Reasoning.** A forced call sets the template variable `enable_thinking = false` unless
//! the request set it (as `response_format` does, [`crate::response_format::no_thinking`]),
//! so templates that honour it close the think block in the prompt. When the prompt still
//! leaves room for reasoning, the grammar allows it first: a prompt that ends inside an open
//! `<think>` (Qwen3.5 / Nemotron 3 with thinking on) must close it with `</think>` before the
//! calls; a reasoning template whose prompt did not close a think block (Qwen3 with thinking
//! on) may open one with `<think>` first. Reasoning text itself is free.
//!
//! **`"none"`** is the grammar `TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/`: any text
//! without the opening tag, whether the model would write it as the single `<tool_call>`
//! token or spell it out; only the end-of-generation tokens remain of the control tokens.
//! Models without a tool-call format get no constraint.
//!
//! Errors are 400s naming `tool_choice`: an unknown value or function name, a forced call
//! without `tools`, a model without a tool-call format, a schema the XML form cannot
//! express, and (reported by `submit`) a grammar llguidance cannot compile, e.g. a
//! `parameters` schema it does not support.

use kapitsa_engine::reply::{THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN};
use kapitsa_engine::structured::with_json_options;
use kapitsa_engine::{Constraint, ReplyFormat, ToolCallFormat};
use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::params::{type_name, Fields};

/// The request field this module reads.
pub const PARAM: &str = "tool_choice";

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_param(PARAM, msg)
}

/// What a request asks of tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (no constraint).
    Auto,
    /// No tool call: tools hidden from the prompt, the opening tag banned.
    None,
    /// One or more tool calls, nothing else.
    Required,
    /// A call of this function, nothing else.
    Function(String),
}

impl ToolChoice {
    /// Whether the reply must be tool calls.
    pub fn forces_call(&self) -> bool {
        matches!(self, ToolChoice::Required | ToolChoice::Function(_))
    }

    fn describe(&self) -> String {
        match self {
            ToolChoice::Auto => "auto".into(),
            ToolChoice::None => "none".into(),
            ToolChoice::Required => "required".into(),
            ToolChoice::Function(n) => format!("function '{n}'"),
        }
    }
}

/// A request's tool choice and its limit on the number of calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolPolicy {
    /// The choice.
    pub choice: ToolChoice,
    /// At most one call (OpenAI `parallel_tool_calls: false`, Anthropic
    /// `disable_parallel_tool_use: true`, or a named function); only forced calls are limited.
    pub single: bool,
}

impl ToolPolicy {
    /// `tool_choice` absent.
    pub fn auto() -> ToolPolicy {
        ToolPolicy {
            choice: ToolChoice::Auto,
            single: false,
        }
    }

    /// The tools to render into the prompt: none for [`ToolChoice::None`], else `tools`.
    pub fn prompt_tools<'a>(&self, tools: Option<&'a Value>) -> Option<&'a Value> {
        match self.choice {
            ToolChoice::None => None,
            _ => tools,
        }
    }
}

/// The function objects of `tools`: OpenAI tool definitions (`{"type": "function",
/// "function": {...}}`) or bare function objects.
fn functions(tools: Option<&Value>) -> impl Iterator<Item = &Value> {
    tools
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|t| t.get("function").unwrap_or(t))
}

fn function_name(f: &Value) -> Option<&str> {
    f.get("name").and_then(Value::as_str)
}

/// Check that a forced choice has tools to call and names one of them.
fn check(choice: &ToolChoice, tools: Option<&Value>, tools_param: &str) -> ApiResult<()> {
    let names: Vec<&str> = functions(tools).filter_map(function_name).collect();
    match choice {
        ToolChoice::Auto | ToolChoice::None => Ok(()),
        c if names.is_empty() => Err(bad(format!(
            "tool_choice {} needs a non-empty '{tools_param}'",
            c.describe()
        ))),
        ToolChoice::Function(n) if !names.contains(&n.as_str()) => Err(bad(format!(
            "tool_choice names the function '{n}', which is not in '{tools_param}' (given: {})",
            names.join(", ")
        ))),
        _ => Ok(()),
    }
}

/// Read OpenAI `tool_choice` (and `parallel_tool_calls`) of a chat request; `tools`: its
/// `tools` array (already checked).
pub fn openai(f: &Fields, tools: Option<&Value>) -> ApiResult<ToolPolicy> {
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let choice = match f.get(PARAM) {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "unknown tool_choice '{other}' (expected 'auto', 'none', 'required' or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}})"
                )))
            }
        },
        Some(Value::Object(o)) => {
            match o.get("type") {
                Some(Value::String(t)) if t == "function" => {}
                Some(Value::String(t)) => {
                    return Err(bad(format!(
                        "tool_choice of type '{t}' is not supported (only 'function')"
                    )))
                }
                _ => return Err(bad("'tool_choice.type' must be 'function'")),
            }
            // Chat completions nest the name in `function`; the Responses API form has it
            // at the top level.
            let name = o
                .get("function")
                .and_then(|x| x.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| bad("'tool_choice.function.name' must be a non-empty string"))?;
            ToolChoice::Function(name.to_string())
        }
        Some(v) => {
            return Err(bad(format!(
                "'tool_choice' must be a string or an object, got {}",
                type_name(v)
            )))
        }
    };
    check(&choice, tools, "tools")?;
    let single = matches!(choice, ToolChoice::Function(_)) || !parallel;
    Ok(ToolPolicy { choice, single })
}

/// Read Anthropic `tool_choice` (`{"type": "auto" | "any" | "tool" | "none", "name",
/// "disable_parallel_tool_use"}`); `tools`: the request's tools in OpenAI form.
pub fn anthropic(tc: Option<&Map<String, Value>>, tools: Option<&Value>) -> ApiResult<ToolPolicy> {
    let Some(tc) = tc else {
        return Ok(ToolPolicy::auto());
    };
    let f = Fields::nested(tc, "tool_choice.");
    let one = f.bool("disable_parallel_tool_use")?.unwrap_or(false);
    let choice = match f.str("type")? {
        Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => {
            let name = f.str("name")?.filter(|n| !n.is_empty()).ok_or_else(|| {
                bad("'tool_choice.name' is required when 'tool_choice.type' is 'tool'")
            })?;
            ToolChoice::Function(name.to_string())
        }
        Some(other) => {
            return Err(bad(format!(
                "unknown tool_choice type '{other}' (expected 'auto', 'any', 'tool' or 'none')"
            )))
        }
        None => return Err(bad("'tool_choice.type' is a required property")),
    };
    check(&choice, tools, "tools")?;
    let single = matches!(choice, ToolChoice::Function(_)) || one;
    Ok(ToolPolicy { choice, single })
}

/// The constraint `p` puts on a reply in `fmt` to the prompt `rendered` (`None`: none).
/// `tools`: every tool of the request, in OpenAI form (a named function must be among them).
pub fn constraint(
    p: &ToolPolicy,
    tools: Option<&Value>,
    fmt: ReplyFormat,
    rendered: &str,
) -> ApiResult<Option<Constraint>> {
    let Some(syntax) = fmt.tool_calls else {
        return if p.choice.forces_call() {
            Err(bad(format!(
                "tool_choice {} cannot be enforced: this model's chat template has no tool-call format",
                p.choice.describe()
            )))
        } else {
            Ok(None)
        };
    };
    let funcs: Vec<&Value> = match &p.choice {
        ToolChoice::Auto => return Ok(None),
        ToolChoice::None => return Ok(Some(Constraint::Lark(no_call_grammar()))),
        ToolChoice::Required => functions(tools).collect(),
        ToolChoice::Function(n) => functions(tools)
            .filter(|f| function_name(f) == Some(n.as_str()))
            .take(1)
            .collect(),
    };
    if funcs.is_empty() {
        return Err(bad(format!(
            "tool_choice {} has no tool to call",
            p.choice.describe()
        )));
    }
    let think = if !fmt.reasoning {
        Think::Off
    } else if fmt.starts_in_reasoning(rendered) {
        Think::Open
    } else if rendered.trim_end().ends_with(THINK_CLOSE) {
        Think::Off
    } else {
        Think::Optional
    };
    calls_grammar(&funcs, syntax, p.single, think).map(|g| Some(Constraint::Lark(g)))
}

/// Where the reply is with respect to reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Think {
    /// No reasoning block.
    Off,
    /// The prompt opened the block: the reply starts inside it.
    Open,
    /// The reply may open a block first.
    Optional,
}

/// Lark for "any text without the tool-call opening tag" (tool_choice `none`).
fn no_call_grammar() -> String {
    format!(
        "start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*){}(?s:.*)/\n",
        regex_escape(TOOL_OPEN)
    )
}

/// A Lark string literal: llguidance reads them as JSON strings.
fn lit(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `s` as a regex matching exactly `s` (inside a Lark `/.../`). Only the regex operators are
/// escaped: `\<` and `\>` would be word boundaries.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        match c {
            '/' => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// A JSON-schema `pattern` (ECMA regex, unanchored: "contains a match") as a Lark regex body
/// matching whole strings: `/` escaped, `\d` / `\w` (and `\D` / `\W`) made ASCII as in
/// ECMA, `^` / `$` anchors kept as the ends of the string, an unanchored end padded with
/// `(?s:.*)`. (A pattern with anchors inside alternatives, `^a|b$`, is read as `^(a|b)$`:
/// stricter, so what it allows is still valid.)
fn pattern_regex(p: &str) -> String {
    let (start, body) = match p.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, p),
    };
    let (end, body) = match body.strip_suffix('$') {
        Some(rest) if !rest.ends_with('\\') => (true, rest),
        _ => (false, body),
    };
    let mut inner = String::with_capacity(body.len() + 8);
    let mut escaped = false;
    for c in body.chars() {
        match (escaped, c) {
            (false, '\\') => {
                escaped = true;
                continue;
            }
            (true, 'd') => inner.push_str("[0-9]"),
            (true, 'D') => inner.push_str("[^0-9]"),
            (true, 'w') => inner.push_str("[0-9a-zA-Z_]"),
            (true, 'W') => inner.push_str("[^0-9a-zA-Z_]"),
            (_, '/') => inner.push_str("\\/"),
            (_, '\n') => inner.push_str("\\n"),
            (true, c) => {
                inner.push('\\');
                inner.push(c);
            }
            (false, c) => inner.push(c),
        }
        escaped = false;
    }
    format!(
        "{}(?:{inner}){}",
        if start { "" } else { "(?s:.*)" },
        if end { "" } else { "(?s:.*)" }
    )
}

/// `%json` with the compact JSON of `schema` (plus our JSON options).
fn json_atom(schema: Value) -> String {
    format!("%json {}", with_json_options(schema))
}

/// A function's `parameters`, an object schema: absent / null -> `{"type": "object"}`, no
/// `type` -> `"type": "object"` added (the reply parser only takes object arguments).
fn object_schema(f: &Value) -> ApiResult<Map<String, Value>> {
    let mut s = match f.get("parameters") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => {
            return Err(bad(format!(
                "the parameters of '{}' must be a JSON schema object, got {}",
                function_name(f).unwrap_or(""),
                type_name(v)
            )))
        }
    };
    s.entry("type").or_insert_with(|| "object".into());
    Ok(s)
}

/// Check a function or parameter name for the XML form (`<function=N>`, `<parameter=N>`).
fn xml_name<'a>(kind: &str, n: &'a str) -> ApiResult<&'a str> {
    if n.is_empty() || n.trim() != n || n.contains(['<', '>', '\n', '\r']) {
        return Err(bad(format!(
            "the {kind} name '{n}' cannot be written in this model's tool-call format (no '<', '>', line breaks or surrounding spaces)"
        )));
    }
    Ok(n)
}

/// The grammar of a reply made of calls of `funcs`.
fn calls_grammar(
    funcs: &[&Value],
    syntax: ToolCallFormat,
    single: bool,
    think: Think,
) -> ApiResult<String> {
    let mut g = String::new();
    let calls = if single {
        "call".to_string()
    } else {
        format!("call ({} call)*", lit("\n"))
    };
    match think {
        Think::Off => g.push_str(&format!("start: {calls}\n")),
        Think::Open => g.push_str(&format!("start: think SEP? {calls}\n")),
        Think::Optional => g.push_str(&format!(
            "start: ({} think SEP?)? {calls}\n",
            lit(THINK_OPEN)
        )),
    }
    if think != Think::Off {
        g.push_str(&format!(
            "think[suffix={}]: /(?s:.*)/\nSEP: /[ \\t\\r\\n]{{1,8}}/\n",
            lit(THINK_CLOSE)
        ));
    }
    let alts: Vec<String> = (0..funcs.len()).map(|i| format!("fn_{i}")).collect();
    match syntax {
        ToolCallFormat::Json => {
            g.push_str(&format!(
                "call: {} ({}) {}\n",
                lit(&format!("{TOOL_OPEN}\n")),
                alts.join(" | "),
                lit(&format!("\n{TOOL_CLOSE}"))
            ));
            for (i, f) in funcs.iter().enumerate() {
                let name = function_name(f).unwrap_or("");
                let head = format!(
                    "{{\"name\": {}, \"arguments\": ",
                    Value::String(name.to_string())
                );
                g.push_str(&format!(
                    "fn_{i}: {} {} {}\n",
                    lit(&head),
                    json_atom(Value::Object(object_schema(f)?)),
                    lit("}")
                ));
            }
        }
        ToolCallFormat::XmlFunction => {
            g.push_str(&format!(
                "call: {} ({}) {}\n",
                lit(&format!("{TOOL_OPEN}\n")),
                alts.join(" | "),
                lit(&format!("</function>\n{TOOL_CLOSE}"))
            ));
            for (i, f) in funcs.iter().enumerate() {
                xml_function(&mut g, i, f)?;
            }
        }
    }
    Ok(g)
}

/// Top-level keywords of a `parameters` schema the XML form can honour.
const XML_OBJECT_KEYS: [&str; 12] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "description",
    "title",
    "$schema",
    "$id",
    "$defs",
    "definitions",
    "$comment",
    "examples",
];

/// Rules `fn_{i}` (and its parameters) for function `f` in the XML form.
fn xml_function(g: &mut String, i: usize, f: &Value) -> ApiResult<()> {
    let name = xml_name("function", function_name(f).unwrap_or(""))?;
    let schema = object_schema(f)?;
    if let Some(k) = schema
        .keys()
        .find(|k| !XML_OBJECT_KEYS.contains(&k.as_str()))
    {
        return Err(bad(format!(
            "the parameters schema of '{name}' uses '{k}', which this model's tool-call format cannot enforce"
        )));
    }
    if schema.get("type").and_then(Value::as_str) != Some("object") {
        return Err(bad(format!(
            "the parameters schema of '{name}' must have type 'object'"
        )));
    }
    let empty = Map::new();
    let props = match schema.get("properties") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(p)) => p,
        Some(_) => {
            return Err(bad(format!(
                "'properties' of the parameters of '{name}' must be an object"
            )))
        }
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    // Definitions travel with every parameter schema (local `$ref`s point there).
    let defs: Vec<(&String, &Value)> = schema
        .iter()
        .filter(|(k, _)| *k == "$defs" || *k == "definitions")
        .collect();
    let mut params: Vec<(&str, Value, bool)> = props
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone(), required.contains(&k.as_str())))
        .collect();
    // Required names without a schema: any value.
    for r in &required {
        if !props.contains_key(*r) && !params.iter().any(|(n, _, _)| n == r) {
            params.push((r, Value::Object(Map::new()), true));
        }
    }
    let mut seq = vec![lit(&format!("<function={name}>\n"))];
    for (j, (pname, pschema, req)) in params.into_iter().enumerate() {
        let pname = xml_name("parameter", pname)?;
        let rule = format!("p_{i}_{j}");
        seq.push(if req {
            rule.clone()
        } else {
            format!("{rule}?")
        });
        let open = lit(&format!("<parameter={pname}>\n"));
        let close = "\n</parameter>\n";
        match xml_type(&pschema) {
            Some("string") => {
                if let Some(alts) = string_literals(&pschema) {
                    g.push_str(&format!("{rule}: {open} ({}) {}\n", alts, lit(close)));
                } else {
                    g.push_str(&format!("{rule}: {open} v_{i}_{j}\n"));
                    g.push_str(&format!("v_{i}_{j}[suffix={}]: V_{i}_{j}\n", lit(close)));
                    g.push_str(&format!("V_{i}_{j}: {}\n", string_terminal(&pschema)));
                }
            }
            Some("boolean") => g.push_str(&format!(
                "{rule}: {open} (\"true\" | \"false\" | \"True\" | \"False\") {}\n",
                lit(close)
            )),
            _ => {
                let mut s = match pschema {
                    Value::Object(o) => o,
                    // `true` (any value) or a malformed schema: llguidance decides.
                    other => {
                        let mut m = Map::new();
                        if other == Value::Bool(false) {
                            m.insert("not".into(), Value::Object(Map::new()));
                        }
                        m
                    }
                };
                for (k, v) in &defs {
                    s.entry((*k).clone()).or_insert_with(|| (*v).clone());
                }
                g.push_str(&format!(
                    "{rule}: {open} {} {}\n",
                    json_atom(Value::Object(s)),
                    lit(close)
                ));
            }
        }
    }
    g.push_str(&format!("fn_{i}: {}\n", seq.join(" ")));
    Ok(())
}

/// The parameter type as the reply parser reads it (`"type": T` or `["T", "null"]`).
fn xml_type(schema: &Value) -> Option<&str> {
    match schema.get("type")? {
        Value::String(s) => Some(s),
        Value::Array(a) => {
            let non_null: Vec<&str> = a
                .iter()
                .filter_map(Value::as_str)
                .filter(|s| *s != "null")
                .collect();
            match non_null.as_slice() {
                [one] => Some(one),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `("a" | "b")` for a string schema with `const` or an all-string `enum`.
fn string_literals(schema: &Value) -> Option<String> {
    let values: Vec<&str> = if let Some(c) = schema.get("const") {
        vec![c.as_str()?]
    } else {
        let e = schema.get("enum")?.as_array()?;
        let v: Option<Vec<&str>> = e.iter().map(Value::as_str).collect();
        v?
    };
    if values.is_empty() {
        return None;
    }
    Some(
        values
            .iter()
            .map(|v| lit(v))
            .collect::<Vec<_>>()
            .join(" | "),
    )
}

/// The Lark terminal of a raw string parameter's text: length bounds and `pattern`.
fn string_terminal(schema: &Value) -> String {
    let min = schema.get("minLength").and_then(Value::as_u64);
    let max = schema.get("maxLength").and_then(Value::as_u64);
    let len = match (min, max) {
        (None, None) => None,
        (lo, None) => Some(format!("/(?s:.{{{},}})/", lo.unwrap_or(0))),
        (lo, Some(hi)) => Some(format!("/(?s:.{{{},{hi}}})/", lo.unwrap_or(0))),
    };
    let pat = schema
        .get("pattern")
        .and_then(Value::as_str)
        .map(|p| format!("/{}/", pattern_regex(p)));
    match (len, pat) {
        (Some(l), Some(p)) => format!("{l} & {p}"),
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => "/(?s:.*)/".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add"}},
        ])
    }

    fn openai_run(v: Value) -> ApiResult<ToolPolicy> {
        let t = tools();
        openai(&Fields::new(v.as_object().unwrap()), Some(&t))
    }

    #[test]
    fn openai_choices() {
        assert_eq!(openai_run(json!({})).unwrap(), ToolPolicy::auto());
        assert_eq!(
            openai_run(json!({"tool_choice": "none"})).unwrap().choice,
            ToolChoice::None
        );
        let p = openai_run(json!({"tool_choice": "required", "parallel_tool_calls": false}));
        assert_eq!(
            p.unwrap(),
            ToolPolicy {
                choice: ToolChoice::Required,
                single: true
            }
        );
        let p =
            openai_run(json!({"tool_choice": {"type": "function", "function": {"name": "add"}}}));
        assert_eq!(p.unwrap().choice, ToolChoice::Function("add".into()));
        for bad in [
            json!({"tool_choice": "sometimes"}),
            json!({"tool_choice": 3}),
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            json!({"tool_choice": {"type": "function"}}),
            json!({"tool_choice": {"type": "custom", "name": "add"}}),
        ] {
            let e = openai_run(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(PARAM), "{bad}");
        }
        // A forced call needs tools.
        let v = json!({"tool_choice": "required"});
        let e = openai(&Fields::new(v.as_object().unwrap()), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(PARAM));
    }

    #[test]
    fn anthropic_choices() {
        let t = tools();
        let run = |v: Value| anthropic(v.as_object(), Some(&t));
        assert_eq!(
            run(json!({"type": "any"})).unwrap().choice,
            ToolChoice::Required
        );
        let p = run(json!({"type": "tool", "name": "get_weather"})).unwrap();
        assert!(p.single && p.choice == ToolChoice::Function("get_weather".into()));
        assert!(run(json!({"type": "tool", "name": "x"})).is_err());
        assert!(run(json!({"type": "tool"})).is_err());
        assert!(run(json!({"type": "maybe"})).is_err());
        assert!(anthropic(json!({"type": "any"}).as_object(), None).is_err());
        assert!(anthropic(json!({"type": "none"}).as_object(), None).is_ok());
    }

    #[test]
    fn grammar_text() {
        let t = tools();
        let fmt = ReplyFormat {
            reasoning: false,
            tool_calls: Some(ToolCallFormat::Json),
        };
        let p = ToolPolicy {
            choice: ToolChoice::Function("get_weather".into()),
            single: true,
        };
        let Some(Constraint::Lark(g)) = constraint(&p, Some(&t), fmt, "").unwrap() else {
            panic!("no grammar");
        };
        assert!(g.starts_with("start: call\n"), "{g}");
        assert!(
            g.contains(r#"fn_0: "{\"name\": \"get_weather\", \"arguments\": " %json {"#),
            "{g}"
        );
        assert!(!g.contains("fn_1"), "{g}");
        // No tool-call format: forced calls are refused, `none` needs nothing.
        let plain = ReplyFormat::plain();
        assert!(constraint(&p, Some(&t), plain, "").is_err());
        let none = ToolPolicy {
            choice: ToolChoice::None,
            single: false,
        };
        assert_eq!(constraint(&none, Some(&t), plain, "").unwrap(), None);
        // XML: names that cannot be written are refused.
        let xml = ReplyFormat {
            reasoning: true,
            tool_calls: Some(ToolCallFormat::XmlFunction),
        };
        let bad = json!([{"type": "function", "function": {"name": "a>b"}}]);
        let req = ToolPolicy {
            choice: ToolChoice::Required,
            single: false,
        };
        assert!(constraint(&req, Some(&bad), xml, "").is_err());
        let bad = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "anyOf": []}}}]);
        assert!(constraint(&req, Some(&bad), xml, "").is_err());
        let Some(Constraint::Lark(g)) = constraint(&req, Some(&t), xml, "x<think>\n").unwrap()
        else {
            panic!("no grammar");
        };
        assert!(
            g.starts_with("start: think SEP? call (\"\\n\" call)*\n"),
            "{g}"
        );
    }

    #[test]
    fn patterns() {
        assert_eq!(pattern_regex("^[a-z]+$"), "(?:[a-z]+)");
        assert_eq!(pattern_regex("a/b"), "(?s:.*)(?:a\\/b)(?s:.*)");
        assert_eq!(pattern_regex("x\\$"), "(?s:.*)(?:x\\$)(?s:.*)");
        assert_eq!(pattern_regex("^\\d{3}\\/\\.$"), "(?:[0-9]{3}\\/\\.)");
    }
}
