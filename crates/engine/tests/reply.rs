//! The reply parser (`kapitsa_engine::reply`): every model family's markup, the same result
//! however the text is split, malformed and unterminated markup kept as text, and round trips
//! through the real chat templates in tests/fixtures/templates.

use std::path::{Path, PathBuf};

use kapitsa_engine::reply::{
    parse_reply, ParsedReply, ReplyEvent, ReplyFormat, ReplyParser, ToolCall, ToolCallFormat,
};
use kapitsa_text::ChatTemplate;
use serde_json::{json, Value};

const JSON_THINK: ReplyFormat = ReplyFormat {
    reasoning: true,
    tool_calls: Some(ToolCallFormat::Json),
};
const JSON_ONLY: ReplyFormat = ReplyFormat {
    reasoning: false,
    tool_calls: Some(ToolCallFormat::Json),
};
const XML_THINK: ReplyFormat = ReplyFormat {
    reasoning: true,
    tool_calls: Some(ToolCallFormat::XmlFunction),
};

fn templates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates")
}

/// (compiled template, source) of a fixture template.
fn template(name: &str) -> (ChatTemplate, String) {
    let src = std::fs::read_to_string(templates_dir().join(format!("{name}.jinja")))
        .expect("template fixture");
    let t = ChatTemplate::new(&src, None, None).expect("template compiles");
    (t, src)
}

/// Adjacent text events of the same kind merged, so that event lists from differently split
/// inputs compare equal.
fn merged(events: Vec<ReplyEvent>) -> Vec<ReplyEvent> {
    let mut out: Vec<ReplyEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(ReplyEvent::Reasoning(a)), ReplyEvent::Reasoning(b)) => a.push_str(&b),
            (Some(ReplyEvent::Content(a)), ReplyEvent::Content(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

/// Feed `pieces` one by one; returns the merged events and the parsed reply.
fn run(
    fmt: ReplyFormat,
    starts_in_reasoning: bool,
    pieces: &[&str],
) -> (Vec<ReplyEvent>, ParsedReply) {
    let mut p = ReplyParser::new(fmt, starts_in_reasoning);
    let mut events = Vec::new();
    for piece in pieces {
        for e in p.push(piece) {
            assert!(
                !matches!(&e, ReplyEvent::Reasoning(s) | ReplyEvent::Content(s) if s.is_empty()),
                "empty text event"
            );
            events.push(e);
        }
    }
    let (rest, reply) = p.finish();
    events.extend(rest);
    (merged(events), reply)
}

/// The events must add up to the reply.
fn check_events_match_reply(events: &[ReplyEvent], reply: &ParsedReply, ctx: &str) {
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls = Vec::new();
    for e in events {
        match e {
            ReplyEvent::Reasoning(s) => reasoning.push_str(s),
            ReplyEvent::Content(s) => content.push_str(s),
            ReplyEvent::ToolCall(c) => calls.push(c.clone()),
        }
    }
    assert_eq!(
        reasoning,
        reply.reasoning.clone().unwrap_or_default(),
        "{ctx}"
    );
    assert_eq!(content, reply.content, "{ctx}");
    assert_eq!(calls, reply.tool_calls, "{ctx}");
}

/// Parse `raw` whole, split in two at every char boundary, char by char and in a few pseudo-
/// random multi-piece splits: every way must give the same events and reply. Returns the reply.
fn parse_all_splits(fmt: ReplyFormat, starts_in_reasoning: bool, raw: &str) -> ParsedReply {
    let (want_events, want) = run(fmt, starts_in_reasoning, &[raw]);
    check_events_match_reply(&want_events, &want, raw);
    assert_eq!(parse_reply(fmt, starts_in_reasoning, raw), want);
    let bounds: Vec<usize> = raw
        .char_indices()
        .map(|(i, _)| i)
        .chain([raw.len()])
        .collect();
    for &i in &bounds {
        let got = run(fmt, starts_in_reasoning, &[&raw[..i], &raw[i..]]);
        assert_eq!(
            got,
            (want_events.clone(), want.clone()),
            "split at {i}: {raw:?}"
        );
    }
    let chars: Vec<String> = raw.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        run(fmt, starts_in_reasoning, &pieces),
        (want_events.clone(), want.clone()),
        "char by char: {raw:?}"
    );
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for _ in 0..50 {
        let mut cuts = vec![0];
        for _ in 0..4 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            cuts.push(bounds[(seed % bounds.len() as u64) as usize]);
        }
        cuts.push(raw.len());
        cuts.sort_unstable();
        let pieces: Vec<&str> = cuts.windows(2).map(|w| &raw[w[0]..w[1]]).collect();
        assert_eq!(
            run(fmt, starts_in_reasoning, &pieces),
            (want_events.clone(), want.clone()),
            "cuts {cuts:?}: {raw:?}"
        );
    }
    want
}

fn call(name: &str, arguments: Value) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments,
    }
}

// ---------------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------------

#[test]
fn detects_format_from_templates() {
    let want = [
        ("qwen2.5", JSON_ONLY),
        ("qwen3", JSON_THINK),
        ("qwen3.5", XML_THINK),
        ("nemotron3-nano", XML_THINK),
    ];
    for (name, fmt) in want {
        assert_eq!(ReplyFormat::from_template(&template(name).1), fmt, "{name}");
    }
    let chatml =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    assert_eq!(ReplyFormat::from_template(chatml), ReplyFormat::plain());
}

#[test]
fn detects_reasoning_opened_by_the_prompt() {
    let user = json!([{"role": "user", "content": "hi"}]);
    let on = json!({"enable_thinking": true});
    let off = json!({"enable_thinking": false});
    // (template, starts in reasoning by default / with thinking on / off)
    for (name, default, with_on, with_off) in [
        ("qwen2.5", false, false, false),
        ("qwen3", false, false, false),
        ("qwen3.5", true, true, false),
        ("nemotron3-nano", true, true, false),
    ] {
        let (t, src) = template(name);
        let fmt = ReplyFormat::from_template(&src);
        let r = |extra: Option<&Value>| {
            let prompt = t.render(&user, None, true, extra).expect("render");
            fmt.starts_in_reasoning(&prompt)
        };
        assert_eq!(r(None), default, "{name} default");
        assert_eq!(r(Some(&on)), with_on, "{name} thinking on");
        assert_eq!(r(Some(&off)), with_off, "{name} thinking off");
    }
    assert!(!ReplyFormat::plain().starts_in_reasoning("<think>\n"));
    assert!(!XML_THINK.starts_in_reasoning("<think></think>"));
}

#[test]
fn qwen25_json_tool_calls_with_content() {
    let raw = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    let r = parse_all_splits(JSON_ONLY, false, raw);
    assert_eq!(r.reasoning, None);
    assert_eq!(r.content, "Let me check both.");
    assert_eq!(
        r.tool_calls,
        vec![
            call("get_weather", json!({"city": "Zürich", "days": 2})),
            call("now", json!({})),
        ]
    );
    assert_eq!(
        r.tool_calls[0].arguments_json(),
        r#"{"city":"Zürich","days":2}"#
    );
}

#[test]
fn json_call_variants() {
    // Arguments as a JSON string, "parameters" for "arguments", no arguments at all.
    let raw = "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call><tool_call>{\"name\": \"b\", \"parameters\": {\"y\": [1]}}</tool_call><tool_call>{\"name\": \"c\"}</tool_call>";
    let r = parse_all_splits(JSON_ONLY, false, raw);
    assert_eq!(
        r.tool_calls,
        vec![
            call("a", json!({"x": 1})),
            call("b", json!({"y": [1]})),
            call("c", json!({})),
        ]
    );
    assert_eq!(r.content, "");
    // Not calls: no name, arguments not an object, not an object at all.
    for body in [
        r#"{"arguments": {}}"#,
        r#"{"name": "", "arguments": {}}"#,
        r#"{"name": "f", "arguments": [1]}"#,
        r#"{"name": "f", "arguments": "not json"}"#,
        r#"["f"]"#,
    ] {
        let raw = format!("<tool_call>\n{body}\n</tool_call>");
        let r = parse_all_splits(JSON_ONLY, false, &raw);
        assert!(r.tool_calls.is_empty(), "{body}");
        assert_eq!(r.content, raw);
    }
}

#[test]
fn qwen3_think_content_and_call() {
    let raw = "<think>\nThe user wants the weather.\nCall the tool.\n</think>\n\nSure — checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}\n</tool_call>";
    let r = parse_all_splits(JSON_THINK, false, raw);
    assert_eq!(
        r.reasoning.as_deref(),
        Some("The user wants the weather.\nCall the tool.")
    );
    assert_eq!(r.content, "Sure — checking.");
    assert_eq!(
        r.tool_calls,
        vec![call("get_weather", json!({"city": "東京"}))]
    );
    // Thinking off: the prompt holds the empty block and the reply is plain content; an empty
    // block in the reply itself gives empty reasoning.
    let r = parse_all_splits(JSON_THINK, false, "Hello there.\n");
    assert_eq!((r.reasoning, r.content.as_str()), (None, "Hello there."));
    let r = parse_all_splits(JSON_THINK, false, "<think>\n\n</think>\n\nHello.");
    assert_eq!(
        (r.reasoning.as_deref(), r.content.as_str()),
        (Some(""), "Hello.")
    );
}

#[test]
fn qwen35_xml_calls_in_reasoning_prompt() {
    let raw = "The user asks two things.\nUse both tools.\n</think>\n\nI'll look these up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=include_alerts>\nTrue\n</parameter>\n<parameter=precision>\n0.25\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run_sql>\n<parameter=query>\nSELECT *\nFROM users\nWHERE a < 18\n</parameter>\n<parameter=params>\n[\"a'b\", \"c\\\"d\"]\n</parameter>\n<parameter=options>\n{\"timeout_ms\": 500, \"dry_run\": false}\n</parameter>\n<parameter=note>\n\"quoted\"\n</parameter>\n</function>\n</tool_call>";
    let r = parse_all_splits(XML_THINK, true, raw);
    assert_eq!(
        r.reasoning.as_deref(),
        Some("The user asks two things.\nUse both tools.")
    );
    assert_eq!(r.content, "I'll look these up.");
    assert_eq!(
        r.tool_calls,
        vec![
            call(
                "get_weather",
                json!({"city": "Zürich", "days": 2, "include_alerts": "True", "precision": 0.25})
            ),
            call(
                "run_sql",
                json!({
                    "query": "SELECT *\nFROM users\nWHERE a < 18",
                    "params": ["a'b", "c\"d"],
                    "options": {"timeout_ms": 500, "dry_run": false},
                    "note": "quoted",
                })
            ),
        ]
    );
    // The argument order of the reply is kept (the templates render them in map order).
    let keys: Vec<&String> = r.tool_calls[1]
        .arguments
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    assert_eq!(keys, ["query", "params", "options", "note"]);
}

#[test]
fn xml_values_typed_by_tool_schemas() {
    let tools = json!([
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "zip": {"type": "string"},
            "flag": {"type": "boolean"},
            "n": {"type": "integer"},
            "maybe": {"type": ["string", "null"]},
        }}}},
        {"name": "g", "parameters": {"properties": {"flag": {"type": "string"}}}},
    ]);
    let raw = "<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n<parameter=n>\n7\n</parameter>\n<parameter=maybe>\n42\n</parameter>\n<parameter=other>\ntrue\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=g>\n<parameter=flag>\ntrue\n</parameter>\n</function>\n</tool_call>";
    let mut p = ReplyParser::new(XML_THINK, false).with_tools(&tools);
    p.push(raw);
    let (_, r) = p.finish();
    assert_eq!(
        r.tool_calls,
        vec![
            call(
                "f",
                json!({"zip": "01234", "flag": true, "n": 7, "maybe": "42", "other": true})
            ),
            call("g", json!({"flag": "true"})),
        ]
    );
    // Without schemas: JSON when it parses, else the text.
    let r = parse_reply(XML_THINK, false, raw);
    assert_eq!(
        r.tool_calls[0].arguments,
        json!({"zip": "01234", "flag": "True", "n": 7, "maybe": 42, "other": true})
    );
}

#[test]
fn nemotron_xml_call() {
    let raw = "Need the tool.\n</think>\nOne moment.\n<tool_call>\n<function=search>\n<parameter=q>\nrust </parameter> tag\n</parameter>\n<parameter=k>\n3\n</parameter>\n</function>\n</tool_call>\n";
    let r = parse_all_splits(XML_THINK, true, raw);
    assert_eq!(r.reasoning.as_deref(), Some("Need the tool."));
    assert_eq!(r.content, "One moment.");
    // A value may contain `</parameter>` when it is not followed by another parameter.
    assert_eq!(
        r.tool_calls,
        vec![call(
            "search",
            json!({"q": "rust </parameter> tag", "k": 3})
        )]
    );
    // A call without parameters.
    let r = parse_all_splits(
        XML_THINK,
        false,
        "<tool_call>\n<function=now>\n</function>\n</tool_call>",
    );
    assert_eq!(r.tool_calls, vec![call("now", json!({}))]);
}

// ---------------------------------------------------------------------------------------------
// Unterminated, malformed and odd input
// ---------------------------------------------------------------------------------------------

#[test]
fn unterminated_reasoning_stays_reasoning() {
    let r = parse_all_splits(XML_THINK, true, "Let me think about <tool_call> and </thi");
    assert_eq!(
        r.reasoning.as_deref(),
        Some("Let me think about <tool_call> and </thi")
    );
    assert_eq!(r.content, "");
    assert!(r.tool_calls.is_empty());
    let r = parse_all_splits(JSON_THINK, false, "  <think>\nstill going\n");
    assert_eq!(
        (r.reasoning.as_deref(), r.content.as_str()),
        (Some("still going"), "")
    );
    // Only the start of `<think>` at the end of the reply: content.
    let r = parse_all_splits(JSON_THINK, false, "<thi");
    assert_eq!((r.reasoning, r.content.as_str()), (None, "<thi"));
    // Empty reply.
    assert_eq!(
        parse_all_splits(XML_THINK, true, ""),
        ParsedReply {
            reasoning: Some(String::new()),
            ..Default::default()
        }
    );
    assert_eq!(
        parse_all_splits(JSON_THINK, false, ""),
        ParsedReply::default()
    );
}

#[test]
fn malformed_tool_calls_become_content() {
    // Bad JSON, then a good call: the bad one is text, the good one a call.
    let raw = "Try: <tool_call>\n{\"name\": \"f\", \"arguments\": {oops}}\n</tool_call> then <tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    let r = parse_all_splits(JSON_ONLY, false, raw);
    assert_eq!(
        r.content,
        "Try: <tool_call>\n{\"name\": \"f\", \"arguments\": {oops}}\n</tool_call> then"
    );
    assert_eq!(r.tool_calls, vec![call("g", json!({}))]);
    // XML without `</function>`, without `</parameter>`, with text after a parameter, with
    // text after `</function>`, without a name; JSON in the XML format.
    for raw in [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nhm\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n</function>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    ] {
        let r = parse_all_splits(XML_THINK, false, raw);
        assert!(r.tool_calls.is_empty(), "{raw}");
        assert_eq!(r.content, raw);
    }
}

#[test]
fn unterminated_tool_call_is_content() {
    let raw = "Calling.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_";
    let r = parse_all_splits(JSON_THINK, false, raw);
    assert!(r.tool_calls.is_empty());
    assert_eq!(r.content, raw);
    // Nothing of a pending call is streamed before the end.
    let mut p = ReplyParser::new(JSON_THINK, false);
    assert_eq!(
        p.push("Calling.\n<tool_call>\n{\"name\": "),
        vec![ReplyEvent::Content("Calling.".into())]
    );
    assert_eq!(p.push("\"f\"}\n"), vec![]);
    let (rest, _) = p.finish();
    assert_eq!(
        rest,
        vec![ReplyEvent::Content(
            "\n<tool_call>\n{\"name\": \"f\"}".into()
        )]
    );
}

#[test]
fn reopened_tool_call_abandons_the_first() {
    let raw = "<tool_call> oops <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
    let r = parse_all_splits(JSON_ONLY, false, raw);
    assert_eq!(r.content, "<tool_call> oops");
    assert_eq!(r.tool_calls, vec![call("f", json!({}))]);
}

/// Documented choice: the parser does not track Markdown, so a well-formed tool call inside a
/// code block is a call (as in llama.cpp and vLLM); the code fences stay content.
#[test]
fn tool_call_inside_code_block_is_parsed() {
    let raw = "Example:\n```\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n```\nDone.";
    let r = parse_all_splits(JSON_THINK, false, raw);
    assert_eq!(r.tool_calls, vec![call("f", json!({"x": 1}))]);
    assert_eq!(r.content, "Example:\n```\n\n```\nDone.");
}

#[test]
fn think_only_opens_at_the_start() {
    let raw = "Use <think> tags like <think>this</think>.";
    let r = parse_all_splits(JSON_THINK, false, raw);
    assert_eq!((r.reasoning, r.content.as_str()), (None, raw));
    // A format without reasoning never opens it.
    let r = parse_all_splits(JSON_ONLY, false, "<think>x</think>y");
    assert_eq!(
        (r.reasoning, r.content.as_str()),
        (None, "<think>x</think>y")
    );
    // After the reasoning block, a second `<think>` is content.
    let r = parse_all_splits(JSON_THINK, false, "<think>a</think><think>b</think>");
    assert_eq!(
        (r.reasoning.as_deref(), r.content.as_str()),
        (Some("a"), "<think>b</think>")
    );
}

#[test]
fn plain_format_passes_text_through() {
    let raw = "  <think>x</think> <tool_call>{\"name\": \"f\"}</tool_call>\n\n";
    let (events, r) = run(ReplyFormat::plain(), true, &[raw]);
    assert_eq!(
        r,
        ParsedReply {
            content: raw.into(),
            ..Default::default()
        }
    );
    assert_eq!(events, vec![ReplyEvent::Content(raw.into())]);
    assert_eq!(
        parse_all_splits(ReplyFormat::plain(), false, raw).content,
        raw
    );
}

#[test]
fn content_whitespace_is_held_not_lost() {
    let mut p = ReplyParser::new(JSON_THINK, false);
    assert_eq!(
        p.push("\n\nHello  "),
        vec![ReplyEvent::Content("Hello".into())]
    );
    assert_eq!(p.push("\n"), vec![]);
    assert_eq!(
        p.push("world"),
        vec![ReplyEvent::Content("  \nworld".into())]
    );
    let (rest, r) = p.finish();
    assert!(rest.is_empty());
    assert_eq!(r.content, "Hello  \nworld");
}

#[test]
fn to_message_shape() {
    let r = ParsedReply {
        reasoning: Some("why".into()),
        content: "ok".into(),
        tool_calls: vec![call("f", json!({"a": 1}))],
    };
    assert_eq!(
        r.to_message(),
        json!({
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "why",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        })
    );
    assert_eq!(
        ParsedReply::default().to_message(),
        json!({"role": "assistant", "content": ""})
    );
}

// ---------------------------------------------------------------------------------------------
// Round trips through the real templates
// ---------------------------------------------------------------------------------------------

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather forecast.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}
        }, "required": ["city"]}
    }}])
}

/// Render the generation prompt for one user message, parse `raw` as the reply to it, put
/// `to_message()` into the history and render again: the assistant turn must be `raw` exactly.
fn round_trip(name: &str, extra: Option<Value>, raw: &str) -> ParsedReply {
    let (t, src) = template(name);
    let fmt = ReplyFormat::from_template(&src);
    let tools = weather_tools();
    let user = json!([{"role": "user", "content": "Weather in Zürich?"}]);
    let prompt = t
        .render(&user, Some(&tools), true, extra.as_ref())
        .expect("render prompt");
    let reply = parse_all_splits(fmt, fmt.starts_in_reasoning(&prompt), raw);
    let mut msgs = user.as_array().cloned().unwrap_or_default();
    msgs.push(reply.to_message());
    let full = t
        .render(&Value::Array(msgs), Some(&tools), false, extra.as_ref())
        .expect("render history");
    assert_eq!(full, format!("{prompt}{raw}<|im_end|>\n"), "{name}");
    reply
}

#[test]
fn round_trip_qwen35() {
    let raw = "The user wants the weather in Zürich.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>";
    let r = round_trip("qwen3.5", None, raw);
    assert_eq!(r.tool_calls.len(), 2);
    assert_eq!(
        r.tool_calls[0].arguments,
        json!({"city": "Zürich", "days": 2})
    );
    // No content before the call.
    round_trip(
        "qwen3.5",
        None,
        "Just call it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>",
    );
    // A plain answer, thinking on and off.
    round_trip("qwen3.5", None, "Simple.\n</think>\n\nIt is sunny.");
    round_trip(
        "qwen3.5",
        Some(json!({"enable_thinking": false})),
        "It is sunny.",
    );
}

#[test]
fn round_trip_qwen3() {
    let raw = "<think>\nNeed the weather tool.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n</tool_call>";
    let r = round_trip("qwen3", None, raw);
    assert_eq!(r.tool_calls.len(), 2);
    round_trip("qwen3", None, "<think>\nEasy.\n</think>\n\nSunny.");
    round_trip(
        "qwen3",
        Some(json!({"enable_thinking": false})),
        "Sunny, 21 °C.",
    );
}

#[test]
fn round_trip_qwen25() {
    let raw = "Let me look that up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>";
    let r = round_trip("qwen2.5", None, raw);
    assert_eq!(r.content, "Let me look that up.");
    round_trip(
        "qwen2.5",
        None,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>",
    );
    round_trip("qwen2.5", None, "It is sunny.");
}

#[test]
fn round_trip_nemotron() {
    let raw = "User wants weather.\n</think>\nOne moment.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n";
    let r = round_trip("nemotron3-nano", None, raw);
    assert_eq!(r.reasoning.as_deref(), Some("User wants weather."));
    round_trip("nemotron3-nano", None, "Easy.\n</think>\nSunny.");
    round_trip(
        "nemotron3-nano",
        Some(json!({"enable_thinking": false})),
        "Sunny.",
    );
}

/// Earlier turns: the templates drop the reasoning of assistant turns before the last user
/// query, which is why the history keeps the structured message rather than the raw text.
#[test]
fn history_drops_old_reasoning() {
    let (t, src) = template("qwen3.5");
    let fmt = ReplyFormat::from_template(&src);
    let reply = parse_reply(fmt, true, "Secret plan.\n</think>\n\nHi!");
    let msgs = json!([
        {"role": "user", "content": "Hello"},
        reply.to_message(),
        {"role": "user", "content": "Again"},
    ]);
    let out = t.render(&msgs, None, true, None).expect("render");
    assert!(!out.contains("Secret plan."), "{out}");
    assert!(
        out.contains("<|im_start|>assistant\nHi!<|im_end|>\n"),
        "{out}"
    );
}
