//! [`ChatTemplate`]: Hugging Face chat templates rendered with minijinja, configured to behave
//! like `transformers`' jinja2 environment (trim/lstrip blocks, loop controls, Python string
//! methods, `raise_exception`, `strftime_now`, a `json.dumps`-compatible `tojson`).
//!
//! Templates come from model files and run on request data, so a render is bounded (see
//! [`limits`]): minijinja's fuel (one unit per instruction, plus the bytes and items the template
//! makes; it also refuses oversized `indent`/`format` widths before allocating), a recursion
//! limit, an output cap, a depth bound on the inputs and on our own value walks, and a render
//! thread whose stack is sized for the deepest value the fuel can build (minijinja drops and
//! prints nested values recursively). A hostile template ends in [`TextError::TemplateRender`].

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

use crate::error::jinja_message;
use crate::pyfmt::{self, JsonOpts};
use crate::TextError;

/// The bounds of one render, sized from the fixtures' templates (Qwen2.5, Qwen3, Qwen3.5,
/// Nemotron 3): their test conversations take at most ~2,400 fuel, and a 400-message 800 KB
/// conversation ~0.21 fuel per input byte (Nemotron 3, the most expensive).
pub mod limits {
    /// Fuel every render starts with (minijinja units: one per instruction, one per 64 bytes
    /// made); 40x what the fixtures' largest test conversation takes.
    pub const BASE_FUEL: u64 = 100_000;
    /// Extra fuel per byte of input (messages, tools, extra variables), half a unit: 2.4x the
    /// most expensive real template's rate.
    pub const INPUT_BYTES_PER_FUEL: u64 = 2;
    /// The most fuel any render gets, whatever the input size (inputs past ~4.5 MB may need
    /// more than this with the most expensive real template).
    pub const MAX_FUEL: u64 = 1_000_000;
    /// Stack of the render thread for no fuel; minijinja validated its default recursion limit
    /// on an 8 MiB main-thread stack.
    pub const BASE_STACK: usize = 8 << 20;
    /// Stack bytes per unit of fuel. The cheapest nesting a template can build costs ~1.7 fuel
    /// per level (a list literal in a namespace loop), and the deepest recursion over such a
    /// value (minijinja printing it for `~`) measured under 640 bytes per level.
    pub const STACK_PER_FUEL: usize = 400;
    /// Nested macro calls / recursive loops / includes (minijinja's counter; its default is 500).
    pub const RECURSION_LIMIT: usize = 200;
    /// Deepest nesting of the JSON inputs (messages, tools, extra variables).
    pub const MAX_INPUT_DEPTH: usize = 64;
    /// Output cap for no input; each input byte allows 4 more bytes of output.
    pub const BASE_OUTPUT: usize = 1 << 20;
    /// Longest `tojson(indent=..)` (a number of spaces or a string).
    pub const MAX_INDENT: usize = 64;
    /// Largest width or precision in a `str.format` replacement field (`'{:>20}'.format(x)`);
    /// the Python-compatibility methods allocate the padding before fuel is charged.
    pub const MAX_FORMAT_WIDTH: u64 = 10_000;
}

/// Name under which the template is stored in its environment (no extension, so minijinja does
/// not turn on HTML auto-escaping).
const NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// Replace the training-only `{% generation %}` / `{% endgeneration %}` tags by an always-true
/// `if` block, keeping their whitespace-control markers.
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        // Search after the opening "{%" so that "{%}" cannot yield an end before the start.
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let lead = inner.chars().next().filter(|c| *c == '-' || *c == '+');
        let body = inner.trim_start_matches(['-', '+']);
        let trail = body
            .trim_end()
            .chars()
            .last()
            .filter(|c| *c == '-' || *c == '+');
        let word = body.trim_end_matches(['-', '+']).trim();
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.extend(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.extend(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `raise_exception(msg)`: abort rendering with the template's message.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` with Python `json.dumps` semantics (`ensure_ascii=False` by default, separators
/// `", "` / `": "`, no HTML escaping); honours `indent` (at most [`limits::MAX_INDENT`]),
/// `sort_keys` and `ensure_ascii`.
fn tojson(state: &State, value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            let indent = match v.kind() {
                ValueKind::Number => {
                    // Python treats a negative indent as 0; anything past the cap is refused
                    // before the indent string is built.
                    let width = i64::try_from(v.clone()).unwrap_or(i64::MAX).max(0);
                    if width > limits::MAX_INDENT as i64 {
                        return Err(indent_too_large(&v));
                    }
                    " ".repeat(width as usize)
                }
                _ => v.as_str().unwrap_or_default().to_string(),
            };
            if indent.len() > limits::MAX_INDENT {
                return Err(indent_too_large(&v));
            }
            Some(indent)
        }
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    // Accepted for compatibility; the default separators are the only ones supported.
    let _ = kwargs.get::<Option<Value>>("separators")?;
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        indent,
        sort_keys,
        ensure_ascii,
    };
    Ok(Value::from_safe_string(pyfmt::json_dumps(
        value,
        &opts,
        Some(state),
    )?))
}

/// The error for a `tojson` indent past [`limits::MAX_INDENT`].
fn indent_too_large(indent: &Value) -> Error {
    let shown: String = indent.to_string().chars().take(40).collect();
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: indent {shown} is larger than {} characters",
            limits::MAX_INDENT
        ),
    )
}

/// Python string methods (`minijinja_contrib::pycompat`), with `str.format` refused when a
/// replacement field asks for a width or precision past [`limits::MAX_FORMAT_WIDTH`].
fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if method == "format" {
        if let Some(spec) = value.as_str() {
            check_format_widths(spec)?;
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Refuse a `str.format` string with a number past [`limits::MAX_FORMAT_WIDTH`] inside a
/// `{...}` replacement field (a conservative check: any digit run inside braces counts).
fn check_format_widths(spec: &str) -> Result<(), Error> {
    let mut depth = 0usize;
    let mut number: u64 = 0;
    for c in spec.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        number = match c.to_digit(10) {
            Some(d) if depth > 0 => number.saturating_mul(10).saturating_add(u64::from(d)),
            _ => 0,
        };
        if number > limits::MAX_FORMAT_WIDTH {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "str.format: a width or precision is larger than {}",
                    limits::MAX_FORMAT_WIDTH
                ),
            ));
        }
    }
    Ok(())
}

/// `string` filter with Python `str()` semantics (`True`, `None`, `1.0`, `['a']`).
fn string_filter(state: &State, value: &Value) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => Ok(value.clone()),
        _ => Ok(Value::from(pyfmt::py_str(value, Some(state))?)),
    }
}

/// `pprint` as Python's `repr()` on one line, bounded like `string` (minijinja's own walks the
/// value recursively and indents every level, quadratic in the depth).
fn pprint_filter(state: &State, value: &Value) -> Result<Value, Error> {
    let text = match value.kind() {
        ValueKind::String => pyfmt::py_str(&Value::from(vec![value.clone()]), Some(state))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        _ => pyfmt::py_str(value, Some(state))?,
    };
    Ok(Value::from(text))
}

/// Python's `iterable` / `sequence` tests: strings, lists, dicts and undefined qualify; none,
/// numbers and booleans do not (minijinja's own `iterable` accepts none).
fn is_py_iterable(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
            | ValueKind::Bytes
    )
}

/// Output formatter: print `None`, booleans, floats and containers the way Python does.
fn formatter(out: &mut minijinja::Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => out
            .write_str(&pyfmt::py_str(value, Some(state))?)
            .map_err(Error::from),
        ValueKind::Number if !value.is_integer() => out
            .write_str(&pyfmt::py_str(value, Some(state))?)
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// `strftime_now(format)`: the current UTC time formatted with a subset of C `strftime`
/// (`%Y %y %m %d %e %H %I %M %S %p %j %B %b %A %a %%`).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs)
}

/// Format a UNIX timestamp (UTC) with the `strftime` subset of [`strftime_now`].
fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (secs / 86_400) as i64;
    let sod = secs % 86_400;
    let (hour, minute, second) = (sod / 3600, (sod / 60) % 60, sod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!(
                "{:02}",
                if hour % 12 == 0 { 12 } else { hour % 12 }
            )),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Names a message's reasoning may be given under; the first is the one templates read.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// What `transformers` 5 does to messages before rendering (`_normalize_chat_messages`,
/// `_alias_reasoning_fields`): drop keys whose value is null, and when any reasoning field is set,
/// expose it as both `thinking` (first key) and `reasoning_content`.
fn normalize_messages(messages: &serde_json::Value) -> Result<serde_json::Value, TextError> {
    use serde_json::Value as J;
    let list = messages
        .as_array()
        .ok_or_else(|| TextError::TemplateInput("messages must be an array".into()))?;
    if list.is_empty() {
        return Err(TextError::TemplateInput(
            "cannot apply a chat template to an empty conversation".into(),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for m in list {
        let J::Object(obj) = m else {
            return Err(TextError::TemplateInput(format!(
                "chat messages must be objects, got {m}"
            )));
        };
        let obj: serde_json::Map<String, J> = obj
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let reasoning = REASONING_FIELDS.iter().find_map(|k| obj.get(*k)).cloned();
        let obj = match reasoning {
            None => obj,
            Some(r) => {
                let mut aliased = serde_json::Map::with_capacity(obj.len() + 2);
                aliased.insert("thinking".into(), r.clone());
                for (k, v) in obj {
                    aliased.insert(k, v);
                }
                aliased.insert("reasoning_content".into(), r);
                aliased
            }
        };
        out.push(J::Object(obj));
    }
    Ok(J::Array(out))
}

impl ChatTemplate {
    /// Compile a chat template. `bos_token` / `eos_token` are exposed to the template under
    /// those names, as `transformers` does.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate, TextError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TextError::TemplateSyntax(jinja_message(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(unknown_method);
        env.set_formatter(formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", string_filter);
        env.add_filter("pprint", pprint_filter);
        env.set_recursion_limit(limits::RECURSION_LIMIT);
        env.add_test("iterable", is_py_iterable);
        env.add_test("sequence", is_py_iterable);
        env.add_template_owned(NAME, strip_generation_tags(source))
            .map_err(|e| TextError::TemplateSyntax(jinja_message(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Render a conversation.
    ///
    /// `messages`: array of OpenAI-style messages (`role`, `content` string or null,
    /// `tool_calls`, `tool_call_id`, `reasoning_content`, ...), passed through unchanged.
    /// `tools`: array of tool definitions or `None` (the template then sees `tools` as none).
    /// `extra`: an object of extra template variables (e.g. `{"enable_thinking": false}`); they
    /// override the standard ones.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, TextError> {
        let messages = normalize_messages(messages)?;
        let mut input_bytes = input_size("messages", &messages)?;
        if let Some(t) = tools {
            input_bytes += input_size("tools", t)?;
        }
        if let Some(e) = extra {
            input_bytes += input_size("extra", e)?;
        }
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), messages);
        ctx.insert(
            "tools".into(),
            tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), b.clone().into());
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), e.clone().into());
        }
        match extra {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(map)) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), v.clone());
                }
            }
            Some(_) => return Err(TextError::TemplateInput("extra must be an object".into())),
        }
        let fuel = (limits::BASE_FUEL + input_bytes as u64 / limits::INPUT_BYTES_PER_FUEL)
            .min(limits::MAX_FUEL);
        let max_output = limits::BASE_OUTPUT.saturating_add(input_bytes.saturating_mul(4));
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let stack = limits::BASE_STACK + fuel as usize * limits::STACK_PER_FUEL;
        let ctx = serde_json::Value::Object(ctx);
        // A thread of its own: the stack of whichever thread calls `render` (a 2 MiB async
        // worker, say) is too small for the deepest value the fuel allows (see `limits`).
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(stack)
                .spawn_scoped(scope, || render_bounded(&env, &ctx, max_output))
                .map_err(|e| {
                    TextError::TemplateRender(format!("cannot start the render thread: {e}"))
                })?;
            worker.join().unwrap_or_else(|_| {
                Err(TextError::TemplateRender(
                    "the template engine panicked".into(),
                ))
            })
        })
    }
}

/// Render the stored template of `env` on `ctx`, refusing output past `max_output` bytes.
fn render_bounded(
    env: &Environment<'static>,
    ctx: &serde_json::Value,
    max_output: usize,
) -> Result<String, TextError> {
    let tmpl = env
        .get_template(NAME)
        .map_err(|e| TextError::TemplateRender(jinja_message(&e)))?;
    let mut out = CappedOutput {
        buf: Vec::new(),
        cap: max_output,
    };
    tmpl.render_captured_to(Value::from(minijinja::value::Serde(ctx)), &mut out)
        .map_err(|e| TextError::TemplateRender(jinja_message(&e)))?;
    String::from_utf8(out.buf).map_err(|e| TextError::TemplateRender(e.to_string()))
}

/// A byte sink that fails once more than `cap` bytes were written to it.
struct CappedOutput {
    buf: Vec<u8>,
    cap: usize,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + bytes.len() > self.cap {
            return Err(std::io::Error::other(format!(
                "the rendered prompt is longer than {} bytes",
                self.cap
            )));
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The size in bytes of a JSON input (string bytes plus 8 per value), or an error when it is
/// nested deeper than [`limits::MAX_INPUT_DEPTH`]. Iterative, so any depth is safe to measure.
fn input_size(name: &str, value: &serde_json::Value) -> Result<usize, TextError> {
    let mut size = 0usize;
    let mut pending = vec![(value, 1usize)];
    while let Some((v, depth)) = pending.pop() {
        if depth > limits::MAX_INPUT_DEPTH {
            return Err(TextError::TemplateInput(format!(
                "{name} is nested deeper than {} levels",
                limits::MAX_INPUT_DEPTH
            )));
        }
        size += 8;
        match v {
            serde_json::Value::String(s) => size += s.len(),
            serde_json::Value::Array(items) => {
                pending.extend(items.iter().map(|item| (item, depth + 1)));
            }
            serde_json::Value::Object(map) => {
                for (k, item) in map {
                    size += k.len();
                    pending.push((item, depth + 1));
                }
            }
            _ => {}
        }
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_tags_do_not_panic() {
        for src in ["{%}", "{%", "{%-%}", "{% generation", "%}{%"] {
            let _ = strip_generation_tags(src);
            let _ = ChatTemplate::new(src, None, None);
        }
    }

    #[test]
    fn generation_tags_removed() {
        let src = "a{%- generation -%}b{% endgeneration %}c{% if x %}d{% endif %}";
        assert_eq!(
            strip_generation_tags(src),
            "a{%- if true -%}b{% endif %}c{% if x %}d{% endif %}"
        );
    }

    #[test]
    fn strftime_known_date() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %b %j %%", t),
            "2024-02-29 13:05:09 Thu Feb 060 %"
        );
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
    }

    #[test]
    fn python_semantics() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x.b | string }}|{{ x.n }}|{{ x.f }}|{% for m in messages[::-1] %}{{ m.role }}{% endfor %}|{{ raise_exception is defined }}",
            None,
            None,
        );
        let t = match t {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        };
        let msgs = serde_json::json!([{"role": "1", "content": null}, {"role": "2"}]);
        let extra =
            serde_json::json!({"x": {"s": "Don't <b> & é", "b": true, "n": null, "f": 2.0}});
        let out = t.render(&msgs, None, false, Some(&extra));
        assert_eq!(
            out.ok().as_deref(),
            Some(r#"{"s": "Don't <b> & é", "b": true, "n": null, "f": 2.0}|True|None|2.0|21|True"#)
        );
        let t = ChatTemplate::new("{{ raise_exception('boom') }}", None, None);
        let err = t.ok().map(|t| t.render(&msgs, None, false, None));
        assert!(matches!(err, Some(Err(TextError::TemplateRender(m))) if m.contains("boom")));
    }
}
