//! OpenAI `response_format` -> an engine [`Constraint`] (structured output by constrained
//! decoding, `kapitsa_engine::structured`).
//!
//! | `response_format` | constraint |
//! |---|---|
//! | absent, `{"type": "text"}` | none |
//! | `{"type": "json_object"}` | any JSON object |
//! | `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` | a JSON value valid under `schema` (no `schema`: any JSON value) |
//!
//! `strict` is accepted either way: the schema is always enforced. OpenAI's rule that the
//! messages must mention "JSON" for `json_object` is not applied. Every error here is a 400
//! with `param: "response_format"`; so are schemas the engine cannot compile (reported by
//! `submit`, see [`crate::gen::submit_error`]).

use kapitsa_engine::Constraint;
use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::params::{type_name, Fields};

/// The request field this module reads.
pub const PARAM: &str = "response_format";

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_param(PARAM, msg)
}

/// Read `response_format` from a chat request; `None`: unconstrained.
pub fn parse(f: &Fields) -> ApiResult<Option<Constraint>> {
    let Some(rf) = f.object(PARAM)? else {
        return Ok(None);
    };
    let ty = match rf.get("type") {
        Some(Value::String(t)) => t.as_str(),
        None | Some(Value::Null) => {
            return Err(bad("'response_format.type' is a required property"))
        }
        Some(v) => {
            return Err(bad(format!(
                "'response_format.type' must be a string, got {}",
                type_name(v)
            )))
        }
    };
    match ty {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        "json_schema" => json_schema(rf).map(Some),
        other => Err(bad(format!(
            "unknown response_format type '{other}' (expected 'text', 'json_object' or 'json_schema')"
        ))),
    }
}

/// Template variables for a constrained request: `enable_thinking = false` unless the client
/// set it. The constraint covers the whole reply, so a reasoning model cannot write a
/// `<think>` block first; templates that honour the flag (Qwen3) then close the think block
/// in the prompt and the model answers directly. Templates that ignore it are unaffected (the
/// reply is still constrained from its first token and returned as `content`).
pub fn no_thinking(kwargs: &mut Option<Value>) {
    let v = kwargs.get_or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(o) = v {
        o.entry("enable_thinking").or_insert(Value::Bool(false));
    }
}

/// `{"type": "json_schema", "json_schema": {...}}`.
fn json_schema(rf: &Map<String, Value>) -> ApiResult<Constraint> {
    let js = match rf.get("json_schema") {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => {
            return Err(bad(
                "'response_format.json_schema' is required when 'response_format.type' is 'json_schema'",
            ))
        }
        Some(v) => {
            return Err(bad(format!(
                "'response_format.json_schema' must be an object, got {}",
                type_name(v)
            )))
        }
    };
    match js.get("name") {
        None | Some(Value::Null) => {}
        Some(Value::String(n))
            if !n.is_empty()
                && n.len() <= 64
                && n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
        Some(_) => {
            return Err(bad(
                "'response_format.json_schema.name' must be a string of 1-64 letters, digits, '_' or '-'",
            ))
        }
    }
    if let Some(v) = js.get("strict").filter(|v| !v.is_null() && !v.is_boolean()) {
        return Err(bad(format!(
            "'response_format.json_schema.strict' must be a boolean, got {}",
            type_name(v)
        )));
    }
    let schema = match js.get("schema") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(s @ Value::Object(_)) => s.clone(),
        Some(v) => {
            return Err(bad(format!(
                "'response_format.json_schema.schema' must be a JSON schema object, got {}",
                type_name(v)
            )))
        }
    };
    Ok(Constraint::JsonSchema(schema))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(rf: Value) -> ApiResult<Option<Constraint>> {
        let body = json!({ "response_format": rf });
        parse(&Fields::new(body.as_object().unwrap()))
    }

    #[test]
    fn formats() {
        assert_eq!(run(json!({"type": "text"})).unwrap(), None);
        assert_eq!(run(Value::Null).unwrap(), None);
        assert_eq!(
            run(json!({"type": "json_object"})).unwrap(),
            Some(Constraint::JsonObject)
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            run(json!({"type": "json_schema", "json_schema": {"name": "a_b-1", "schema": s, "strict": true}}))
                .unwrap(),
            Some(Constraint::JsonSchema(s))
        );
        assert_eq!(
            run(json!({"type": "json_schema", "json_schema": {"name": "x"}})).unwrap(),
            Some(Constraint::JsonSchema(json!({})))
        );
    }

    #[test]
    fn thinking_is_off_unless_asked_for() {
        let mut k = None;
        no_thinking(&mut k);
        assert_eq!(k, Some(json!({"enable_thinking": false})));
        let mut k = Some(json!({"enable_thinking": true, "x": 1}));
        no_thinking(&mut k);
        assert_eq!(k, Some(json!({"enable_thinking": true, "x": 1})));
    }

    #[test]
    fn errors_name_response_format() {
        for rf in [
            json!("json_object"),
            json!({}),
            json!({"type": 1}),
            json!({"type": "yaml"}),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": "x"}),
            json!({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}),
            json!({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}),
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        ] {
            let e = run(rf.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(PARAM), "{rf}");
        }
    }
}
