//! Python-compatible text forms of template values: `str()`, `repr()` and `json.dumps()`, so that
//! chat templates render as they do under jinja2 in `transformers`.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

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

/// Python `repr()` of a template value (used inside containers).
fn repr_into(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::String => str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = v.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = v.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr_into(&key, out);
                    out.push_str(": ");
                    repr_into(&v.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&py_str(v)),
    }
}

/// Python `str()` of a template value: `None`, `True`, `1.0`, `['a', 1]`, `{'k': 'v'}`.
/// Undefined renders as the empty string, as jinja2's default `Undefined` does.
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => number_str(v),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            repr_into(v, &mut s);
            s
        }
        _ => v.to_string(),
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

fn json_into(v: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
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
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                json_into(item, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort_by_key(py_str);
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
                    _ => py_str(key),
                };
                json_str(&key_text, opts.ensure_ascii, out);
                out.push_str(": ");
                json_into(&v.get_item(key)?, opts, level + 1, out)?;
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
pub(crate) fn json_dumps(v: &Value, opts: &JsonOpts) -> Result<String, Error> {
    let mut out = String::new();
    json_into(v, opts, 0, &mut out)?;
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
            json_dumps(&v, &compact).unwrap_or_default(),
            r#"{"a": [1, 2.0, "x'<&>\"é\n"], "b": {}, "c": [], "d": null, "e": true}"#
        );
        let pretty = JsonOpts {
            indent: Some("  ".into()),
            sort_keys: false,
            ensure_ascii: true,
        };
        assert_eq!(
            json_dumps(&v, &pretty).unwrap_or_default(),
            "{\n  \"a\": [\n    1,\n    2.0,\n    \"x'<&>\\\"\\u00e9\\n\"\n  ],\n  \"b\": {},\n  \"c\": [],\n  \"d\": null,\n  \"e\": true\n}"
        );
    }

    #[test]
    fn str_like_python() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"k": [true, null, "it's", 1.5]}),
        ));
        assert_eq!(py_str(&v), r#"{'k': [True, None, "it's", 1.5]}"#);
        assert_eq!(py_str(&Value::from(false)), "False");
    }
}
