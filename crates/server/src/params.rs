//! Reading request fields with precise errors: every wrong type or value becomes a 400 that
//! names the field (`param`).

use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};

/// A JSON array of token ids (non-negative integers that fit in `u32`); `param` names the
/// field in the error.
pub fn token_ids(a: &[Value], param: &str) -> ApiResult<Vec<u32>> {
    a.iter()
        .map(|x| {
            x.as_u64()
                .filter(|&t| t <= u64::from(u32::MAX))
                .map(|t| t as u32)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        param,
                        format!("'{param}' must hold token ids (non-negative integers)"),
                    )
                })
        })
        .collect()
}

/// Parse a request body as a JSON object.
pub fn parse_body(body: &[u8]) -> ApiResult<Map<String, Value>> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
        .with_code("invalid_json")
    })?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad("the request body must be a JSON object")),
    }
}

/// The name of a JSON value's type, for messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Typed access to the fields of a JSON object; `null` counts as absent.
#[derive(Clone, Copy)]
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    /// Prefix for `param` in errors (`messages[2].`), empty at the top level.
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    /// The fields of `map`.
    pub fn new(map: &'a Map<String, Value>) -> Fields<'a> {
        Fields { map, prefix: "" }
    }

    /// The fields of `map`, errors naming `prefix` + key.
    pub fn nested(map: &'a Map<String, Value>, prefix: &'a str) -> Fields<'a> {
        Fields { map, prefix }
    }

    /// The name a field has in errors: `prefix` + key.
    pub fn param(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn wrong(&self, key: &str, want: &str, got: &Value) -> ApiError {
        let p = self.param(key);
        ApiError::bad_param(&p, format!("'{p}' must be {want}, got {}", type_name(got)))
    }

    /// The raw value, `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// An error about `key`.
    pub fn error(&self, key: &str, msg: impl Into<String>) -> ApiError {
        ApiError::bad_param(&self.param(key), msg)
    }

    /// A required field.
    pub fn required(&self, key: &str) -> ApiResult<&'a Value> {
        self.get(key).ok_or_else(|| {
            let p = self.param(key);
            ApiError::bad_param(&p, format!("'{p}' is a required property"))
        })
    }

    /// A string.
    pub fn str(&self, key: &str) -> ApiResult<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    /// A boolean.
    pub fn bool(&self, key: &str) -> ApiResult<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, "a boolean", v)),
        }
    }

    /// A finite number.
    pub fn f32(&self, key: &str) -> ApiResult<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                if x.is_finite() {
                    Ok(Some(x))
                } else {
                    Err(self.error(key, format!("'{}' must be finite", self.param(key))))
                }
            }
            Some(v) => Err(self.wrong(key, "a number", v)),
        }
    }

    /// A number in `[lo, hi]`.
    pub fn f32_in(&self, key: &str, lo: f32, hi: f32) -> ApiResult<Option<f32>> {
        let x = self.f32(key)?;
        if let Some(x) = x {
            if !(lo..=hi).contains(&x) {
                let p = self.param(key);
                return Err(self.error(key, format!("'{p}' must be in [{lo}, {hi}], got {x}")));
            }
        }
        Ok(x)
    }

    /// An integer (a float with no fractional part is accepted).
    pub fn i64(&self, key: &str) -> ApiResult<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                if let Some(i) = n.as_i64() {
                    return Ok(Some(i));
                }
                if let Some(u) = n.as_u64() {
                    return Ok(Some(u as i64));
                }
                match n.as_f64() {
                    Some(f) if f.fract() == 0.0 && f.abs() < 9.0e18 => Ok(Some(f as i64)),
                    _ => Err(self.error(
                        key,
                        format!("'{}' must be an integer, got {n}", self.param(key)),
                    )),
                }
            }
            Some(v) => Err(self.wrong(key, "an integer", v)),
        }
    }

    /// An integer in `[lo, hi]`.
    pub fn int_in(&self, key: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
        let x = self.i64(key)?;
        if let Some(x) = x {
            if !(lo..=hi).contains(&x) {
                let p = self.param(key);
                return Err(self.error(key, format!("'{p}' must be in [{lo}, {hi}], got {x}")));
            }
        }
        Ok(x)
    }

    /// An array.
    pub fn array(&self, key: &str) -> ApiResult<Option<&'a Vec<Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong(key, "an array", v)),
        }
    }

    /// An object.
    pub fn object(&self, key: &str) -> ApiResult<Option<&'a Map<String, Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => Err(self.wrong(key, "an object", v)),
        }
    }

    /// A string or an array of strings (`stop`), empty strings dropped; at most `max`.
    pub fn strings(&self, key: &str, max: usize) -> ApiResult<Vec<String>> {
        let out: Vec<String> = match self.get(key) {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => {
                let mut out = Vec::new();
                for (i, v) in a.iter().enumerate() {
                    match v {
                        Value::String(s) => out.push(s.clone()),
                        other => {
                            let p = format!("{}[{i}]", self.param(key));
                            return Err(ApiError::bad_param(
                                &p,
                                format!("'{p}' must be a string, got {}", type_name(other)),
                            ));
                        }
                    }
                }
                out
            }
            Some(v) => return Err(self.wrong(key, "a string or an array of strings", v)),
        };
        if out.len() > max {
            return Err(self.error(
                key,
                format!("'{}' may hold at most {max} strings", self.param(key)),
            ));
        }
        Ok(out.into_iter().filter(|s| !s.is_empty()).collect())
    }
}

/// The `speculative` extension field of the generation endpoints (Kapitsa's own): a mode name
/// (`"auto"`, `"off"`, `"ngram"`, `"draft"`, `"mtp"`, `"dflash"`) or an object `{"mode":
/// ..., "max_draft": N}` (both optional). Absent: the server's settings.
pub fn spec_field(f: &Fields) -> ApiResult<kapitsa_engine::SpecRequest> {
    let mut r = kapitsa_engine::SpecRequest::default();
    let mode = |f: &Fields, key: &str, v: &str| -> ApiResult<kapitsa_engine::SpecMode> {
        v.parse().map_err(|e: String| f.error(key, e))
    };
    match f.get("speculative") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) => r.mode = Some(mode(f, "speculative", m)?),
        Some(Value::Object(o)) => {
            let prefix = f.param("speculative.");
            let of = Fields::nested(o, &prefix);
            if let Some(m) = of.str("mode")? {
                r.mode = Some(mode(&of, "mode", m)?);
            }
            if let Some(n) = of.int_in("max_draft", 0, kapitsa_engine::spec::MAX_DRAFT as i64)? {
                r.max_draft = Some(n as usize);
            }
        }
        Some(v) => {
            return Err(f.error(
                "speculative",
                format!(
                    "'{}' must be a string or an object, not {}",
                    f.param("speculative"),
                    type_name(v)
                ),
            ))
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn typed_fields() {
        let v = json!({"a": 1, "b": 1.5, "c": "x", "d": null, "e": [1], "f": ["s", ""], "g": 2.0});
        let f = Fields::new(v.as_object().unwrap());
        assert_eq!(f.i64("a").unwrap(), Some(1));
        assert_eq!(f.i64("g").unwrap(), Some(2));
        assert!(f.i64("b").is_err());
        assert_eq!(f.f32("b").unwrap(), Some(1.5));
        assert_eq!(f.str("c").unwrap(), Some("x"));
        assert_eq!(f.str("d").unwrap(), None);
        let e = f.str("a").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("a"));
        assert!(f.strings("e", 4).is_err());
        assert_eq!(f.strings("f", 4).unwrap(), vec!["s".to_string()]);
        assert_eq!(f.strings("c", 4).unwrap(), vec!["x".to_string()]);
        assert!(f.f32_in("b", 0.0, 1.0).is_err());
        assert!(f.int_in("a", 2, 3).is_err());
    }
}
