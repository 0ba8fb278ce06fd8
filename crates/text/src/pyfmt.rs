//! Python-compatible text forms of template values: `str()`, `repr()` and `json.dumps()`, so that
//! chat templates render as they do under jinja2 in `transformers`.
//!
//! Templates come from model files, so these walks are bounded: containers nested deeper than
//! [`MAX_DEPTH`] are refused (a template can build a list 100,000 levels deep in a loop), and
//! every item visited is charged to the render's fuel (a lazily repeated list can claim
//! billions of items), so the walk ends with an error instead of a stack overflow or a hang.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, State, Value};

/// Deepest container nesting that `str()`, `repr()` and `json.dumps()` walk (Python's own
/// default recursion limit is 1,000 frames; real chat data is a few levels deep).
pub(crate) const MAX_DEPTH: usize = 128;

/// Fuel charged per container item visited (minijinja charges about this much for an item a
/// built-in filter visits).
const FUEL_PER_ITEM: u64 = 1;

/// Charge the render's fuel for one visited item; a no-op without a state (unit tests).
fn charge_item(state: Option<&State>) -> Result<(), Error> {
    match state {
        Some(st) => st.consume_fuel(FUEL_PER_ITEM),
        None => Ok(()),
    }
}

/// The error for a value nested deeper than [`MAX_DEPTH`].
fn too_deep(what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("{what}: value is nested deeper than {MAX_DEPTH} levels"),
    )
}

/// Python `repr(float)`: shortest round-trip digits, scientific notation when the exponent is
/// below -4 or at least 16, always a `.0` or exponent for integral values.
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // `{:e}` gives the shortest round-trip mantissa, e.g. "1.5e-7" or "1e20".
    let sci = format!("{f:e}");
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let (neg, digits_part) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = digits_part.chars().filter(|c| *c != '.').collect();
    let point = exp + 1; // position of the decimal point within `digits`
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if point <= 0 {
        out.push_str("0.");
        for _ in 0..(-point) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let p = point as usize;
        if digits.len() <= p {
            out.push_str(&digits);
            for _ in digits.len()..p {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..p]);
            out.push('.');
            out.push_str(&digits[p..]);
        }
    }
    out
}

/// A number value as Python would print it.
fn number_str(v: &Value) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        match f64::try_from(v.clone()) {
            Ok(f) => float_repr(f),
            Err(_) => v.to_string(),
        }
    }
}

/// Python `repr(str)`.
fn str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python `repr()` of a template value (used inside containers), `depth` levels down.
fn repr_into(
    v: &Value,
    state: Option<&State>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(too_deep("str"));
    }
    match v.kind() {
        ValueKind::String => str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = v.try_iter() {
                for (i, item) in iter.enumerate() {
                    charge_item(state)?;
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(&item, state, depth + 1, out)?;
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = v.try_iter() {
                for (i, key) in iter.enumerate() {
                    charge_item(state)?;
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(&key, state, depth + 1, out)?;
                    out.push_str(": ");
                    repr_into(&v.get_item(&key).unwrap_or_default(), state, depth + 1, out)?;
                }
            }
            out.push('}');
        }
        _ => out.push_str(&scalar_str(v)),
    }
    Ok(())
}

/// Python `str()` of a value that is not a container.
fn scalar_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => number_str(v),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => v.to_string(),
    }
}

/// Python `str()` of a template value: `None`, `True`, `1.0`, `['a', 1]`, `{'k': 'v'}`.
/// Undefined renders as the empty string, as jinja2's default `Undefined` does. Items visited
/// are charged to `state`'s fuel; containers deeper than [`MAX_DEPTH`] are an error.
pub(crate) fn py_str(v: &Value, state: Option<&State>) -> Result<String, Error> {
    match v.kind() {
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
            let mut s = String::new();
            repr_into(v, state, 0, &mut s)?;
            Ok(s)
        }
        _ => Ok(scalar_str(v)),
    }
}

/// Options of Python's `json.dumps` that templates use.
pub(crate) struct JsonOpts {
    /// Pretty-print with this indent string (Python `indent=`); `None` is compact.
    pub indent: Option<String>,
    /// Sort object keys.
    pub sort_keys: bool,
    /// Escape non-ASCII characters as `\uXXXX`.
    pub ensure_ascii: bool,
}

fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `json.dumps` of `v` at nesting `level` into `out`.
fn json_into(
    v: &Value,
    opts: &JsonOpts,
    state: Option<&State>,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    if level > MAX_DEPTH {
        return Err(too_deep("tojson"));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    let item_sep = if opts.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&float_repr(f));
                }
            }
        }
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let mut empty = true;
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                charge_item(state)?;
                empty = false;
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                json_into(&item, opts, state, level + 1, out)?;
            }
            if empty {
                out.push(']');
                return Ok(());
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys = Vec::new();
            for key in v.try_iter()? {
                charge_item(state)?;
                keys.push(key);
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                let mut sorted = Vec::with_capacity(keys.len());
                for key in keys {
                    sorted.push((py_str(&key, state)?, key));
                }
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                keys = sorted.into_iter().map(|(_, key)| key).collect();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key_text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
                    _ => py_str(key, state)?,
                };
                json_str(&key_text, opts.ensure_ascii, out);
                out.push_str(": ");
                json_into(&v.get_item(key)?, opts, state, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::UndefinedError,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: value of kind {other} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// Python `json.dumps(v, ensure_ascii=.., indent=.., sort_keys=..)` with default separators.
/// Items visited are charged to `state`'s fuel; containers deeper than [`MAX_DEPTH`] are an
/// error.
pub(crate) fn json_dumps(
    v: &Value,
    opts: &JsonOpts,
    state: Option<&State>,
) -> Result<String, Error> {
    let mut out = String::new();
    json_into(v, opts, state, 0, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e-7, "1.5e-07"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (123.456, "123.456"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ];
        for (f, s) in cases {
            assert_eq!(float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v = Value::from(minijinja::value::Serde(serde_json::json!({
            "a": [1, 2.0, "x'<&>\"é\n"], "b": {}, "c": [], "d": null, "e": true
        })));
        let compact = JsonOpts {
            indent: None,
            sort_keys: false,
            ensure_ascii: false,
        };
        assert_eq!(
            json_dumps(&v, &compact, None).unwrap_or_default(),
            r#"{"a": [1, 2.0, "x'<&>\"é\n"], "b": {}, "c": [], "d": null, "e": true}"#
        );
        let pretty = JsonOpts {
            indent: Some("  ".into()),
            sort_keys: false,
            ensure_ascii: true,
        };
        assert_eq!(
            json_dumps(&v, &pretty, None).unwrap_or_default(),
            "{\n  \"a\": [\n    1,\n    2.0,\n    \"x'<&>\\\"\\u00e9\\n\"\n  ],\n  \"b\": {},\n  \"c\": [],\n  \"d\": null,\n  \"e\": true\n}"
        );
    }

    #[test]
    fn str_like_python() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"k": [true, null, "it's", 1.5]}),
        ));
        assert_eq!(
            py_str(&v, None).ok().as_deref(),
            Some(r#"{'k': [True, None, "it's", 1.5]}"#)
        );
        assert_eq!(
            py_str(&Value::from(false), None).ok().as_deref(),
            Some("False")
        );
    }
}
