//! Hostile model files: a corrupt `tokenizer.json` and chat templates that try to exhaust the
//! stack, memory or time end in a typed error, never a panic, abort or hang; the real templates
//! still render long conversations under the same limits.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kapitsa_text::{ChatTemplate, TextError, Tokenizer};

#[test]
fn corrupt_decoder_in_tokenizer_json_is_an_error() {
    // A syntax error inside "decoder" reached an `expect` in the tokenizers crate.
    let bytes = std::fs::read(fixtures().join("tiny/qwen2-a/tokenizer.json")).expect("fixture");
    let text = String::from_utf8(bytes).expect("utf-8");
    let at = text.find("\"decoder\"").expect("the fixture has a decoder");
    let corrupt = [
        format!("{}\"decoder\": {{\"type\": \"ByteLevel\",}}}}", &text[..at]),
        format!(
            "{}\"decoder\": {{\"type\": \"Sequence\", \"decoders\": [1e999]}}}}",
            &text[..at]
        ),
        format!("{}\"decoder\": {{\"type\"", &text[..at]),
    ];
    for json in corrupt {
        let got = Tokenizer::from_tokenizer_json_bytes(json.as_bytes(), None, None);
        assert!(
            matches!(got, Err(TextError::InvalidTokenizer(_))),
            "{:?}",
            got.err()
        );
    }
    // The untouched file still loads.
    assert!(Tokenizer::from_tokenizer_json_bytes(text.as_bytes(), None, None).is_ok());
}

fn render(src: &str) -> Result<String, TextError> {
    let t = ChatTemplate::new(src, None, None)?;
    t.render(
        &serde_json::json!([{"role": "user", "content": "hi"}]),
        None,
        true,
        None,
    )
}

/// A list `depth` levels deep, built by the template in a namespace loop (1,000 per pass).
fn deep_list(depth: usize) -> String {
    let lit = format!("{}ns.x{}", "[".repeat(40), "]".repeat(40));
    format!(
        "{{% set ns = namespace(x=[]) %}}{{% for i in range({}) %}}{{% for j in range(25) %}}\
         {{% set ns.x = {lit} %}}{{% endfor %}}{{% endfor %}}",
        depth / 1000
    )
}

#[test]
fn hostile_templates_end_in_errors() {
    let deep = deep_list(50_000);
    let cases: Vec<(&str, String)> = vec![
        (
            "tojson indent",
            "{{ messages | tojson(indent=1000000000000) }}".into(),
        ),
        (
            "tojson indent string",
            "{{ messages | tojson(indent=' ' * 100000) }}".into(),
        ),
        (
            "indent filter width",
            "{{ 'a\nb\nc' | indent(1000000000000) }}".into(),
        ),
        ("format width", "{{ '%1000000000d' | format(1) }}".into()),
        (
            "format precision",
            "{{ '%.1000000000f' | format(1.0) }}".into(),
        ),
        (
            "str.format width",
            "{{ '{:>1000000000}'.format('a') }}".into(),
        ),
        ("string repeat", "{{ 'ab' * 100000000000 }}".into()),
        (
            "string doubling",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}\
             {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
                .into(),
        ),
        (
            "nested ranges",
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
                .into(),
        ),
        (
            "lazy list repeat",
            "{{ ([1] * 100000000) | tojson }}".into(),
        ),
        (
            "lazy list repeat str",
            "{{ ([1] * 100000000) | string }}".into(),
        ),
        (
            "recursive macro",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}".into(),
        ),
        ("deep tojson", format!("{deep}{{{{ ns.x | tojson }}}}")),
        ("deep string", format!("{deep}{{{{ ns.x | string }}}}")),
        ("deep print", format!("{deep}{{{{ ns.x }}}}")),
        ("deep pprint", format!("{deep}{{{{ ns.x | pprint }}}}")),
        (
            "deep as a very long output",
            format!("{deep}{{{{ ns.x ~ '' }}}}"),
        ),
        ("out of fuel while deep", deep_list(2_000_000)),
        (
            "output cap",
            "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}".into(),
        ),
    ];
    for (name, src) in cases {
        let start = Instant::now();
        let got = render(&src);
        let took = start.elapsed();
        assert!(
            matches!(got, Err(TextError::TemplateRender(_))),
            "{name}: {:?}",
            got.map(|s| s.len())
        );
        assert!(took < Duration::from_secs(5), "{name} took {took:?}");
    }
}

#[test]
fn deep_values_drop_without_overflow() {
    // A 50,000-deep list is within the fuel; printing or dropping it must not overflow the
    // stack of the render thread (minijinja recurses on both).
    for tail in ["done", "{{ ns.x == ns.x }}", "{{ ns.x | length }}"] {
        let got = render(&format!("{}{tail}", deep_list(50_000)));
        assert!(got.is_ok(), "{tail}: {:?}", got.err());
    }
}

#[test]
fn deep_inputs_are_refused() {
    let t = ChatTemplate::new("{{ messages | tojson }}", None, None).expect("compile");
    let mut v = serde_json::json!("x");
    for _ in 0..1000 {
        v = serde_json::json!([v]);
    }
    let msgs = serde_json::json!([{"role": "user", "content": v}]);
    let got = t.render(&msgs, None, false, None);
    assert!(matches!(got, Err(TextError::TemplateInput(_))), "{got:?}");
    let got = t.render(
        &serde_json::json!([{"role": "user", "content": "hi"}]),
        Some(&serde_json::json!([{"type": "function", "function": v}])),
        false,
        None,
    );
    assert!(matches!(got, Err(TextError::TemplateInput(_))), "{got:?}");
}

#[test]
fn real_templates_render_long_conversations_within_limits() {
    let dir = fixtures().join("templates");
    for name in ["qwen2.5", "qwen3", "qwen3.5", "nemotron3-nano"] {
        let src = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).expect("template");
        let cases = read_json(&dir.join(format!("{name}.cases.json")));
        let tools = cases["cases"]
            .as_array()
            .and_then(|c| {
                c.iter()
                    .find_map(|c| c.get("tools").filter(|t| !t.is_null()))
            })
            .cloned()
            .expect("a case with tools");
        let tmpl = ChatTemplate::new(&src, None, None).expect("compile");
        // 600 turns of ~2 KB each with tool definitions and tool calls: 1.2 MB of input.
        let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
        for i in 0..300 {
            messages.push(serde_json::json!({"role": "user", "content": format!("{i} {}", "word ".repeat(400))}));
            messages.push(serde_json::json!({
                "role": "assistant",
                "content": "reply ".repeat(300),
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": i}}}]
            }));
            messages.push(serde_json::json!({"role": "tool", "content": "result"}));
        }
        messages.push(serde_json::json!({"role": "user", "content": "last"}));
        let out = tmpl.render(
            &serde_json::Value::Array(messages),
            Some(&tools),
            true,
            None,
        );
        match out {
            Ok(text) => assert!(text.len() > 1_000_000, "{name}: {}", text.len()),
            Err(e) => panic!("{name}: {e}"),
        }
    }
}
