//! `tool_choice` enforced by constrained decoding, with the real engine on tiny random-weight
//! models: with `required` / a named function / Anthropic `any` / `tool` every reply is tool
//! calls whose arguments validate against the tool's schema (several seeds, streaming or
//! not, the Qwen2.5 JSON format and the Qwen3.5 XML format); with `none` no reply contains a
//! tool call; bad `tool_choice` values are 400s. The grammars themselves are also driven
//! token by token over the tiny tokenizer (texts in the template's format are accepted and
//! parse back to the same calls; out-of-schema and banned texts are refused).

mod common;

use std::sync::{Arc, Mutex};

use common::{cfg, load_tiny, repo, template, Resp, TestServer};
use kapitsa_engine::{
    Constraint, EngineConfig, EngineHandle, ParsedReply, ReplyFormat, ReplyParser, StructuredEnv,
};
use kapitsa_models::KvType;
use kapitsa_server::engine::{
    Engine, EngineMetrics, Event, EventStream, FinishReason, RecvFuture, Request, SubmitError,
    Usage,
};
use kapitsa_server::tool_choice::{self, ToolChoice, ToolPolicy};
use kapitsa_server::ServedModel;
use kapitsa_text::Tokenizer;
use serde_json::{json, Value};

/// A server on tiny model `model` with chat template `tpl` (from tests/fixtures/templates).
async fn start(model: &str, tpl: Option<&str>) -> TestServer {
    let dir = repo().join("tests/fixtures/tiny").join(model);
    let tpl = tpl.map(|t| repo().join("tests/fixtures/templates").join(t));
    let (loaded, served) = load_tiny(&dir, tpl.as_deref());
    // `..default()`: settings added later keep their defaults here.
    #[allow(clippy::needless_update)]
    let ecfg = EngineConfig {
        max_running: 4,
        max_batch_tokens: 256,
        // The tool preambles of the real templates are long for a 400-token vocabulary.
        n_ctx: 2048,
        max_queue: 16,
        kv_type: KvType::F32,
        ..EngineConfig::default()
    };
    let engine =
        EngineHandle::start(loaded.model.clone(), served.tokenizer.clone(), ecfg).expect("engine");
    TestServer::start(Arc::new(engine), served, cfg()).await
}

/// Two tools whose valid arguments are all short, so a random model finishes them.
fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "get_weather",
            json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                    "rain": {"type": "boolean"}
                },
                "required": ["city", "days", "unit"],
                "additionalProperties": false
            }),
        ),
        (
            "add",
            json!({
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -99, "maximum": 99},
                    "b": {"enum": [1, 2, "three"]}
                },
                "required": ["a", "b"],
                "additionalProperties": false
            }),
        ),
    ]
}

fn openai_tools() -> Value {
    schemas()
        .into_iter()
        .map(|(n, s)| json!({"type": "function", "function": {"name": n, "description": "d", "parameters": s}}))
        .collect()
}

fn anthropic_tools() -> Value {
    schemas()
        .into_iter()
        .map(|(n, s)| json!({"name": n, "description": "d", "input_schema": s}))
        .collect()
}

/// Whether `v` is a JSON Schema `integer` in `lo..=hi`: any number with a zero fractional
/// part counts (`1.0` and `-0.0` are integers there, and the sampled grammar may write them).
fn int_in(v: &Value, lo: f64, hi: f64) -> bool {
    v.as_f64()
        .is_some_and(|f| f.fract() == 0.0 && (lo..=hi).contains(&f))
}

/// Check a call against [`schemas`] by hand.
fn check_call(name: &str, args: &Value) {
    let o = args
        .as_object()
        .unwrap_or_else(|| panic!("{name}: arguments are not an object: {args}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    match name {
        "get_weather" => {
            assert!(
                keys == ["city", "days", "unit"] || keys == ["city", "days", "rain", "unit"],
                "{args}"
            );
            let city = o["city"].as_str().unwrap_or_else(|| panic!("{args}"));
            assert!((1..=8).contains(&city.chars().count()), "{args}");
            assert!(int_in(&o["days"], 1.0, 7.0), "{args}");
            assert!(o["unit"] == "C" || o["unit"] == "F", "{args}");
            assert!(o.get("rain").is_none_or(Value::is_boolean), "{args}");
        }
        "add" => {
            assert_eq!(keys, ["a", "b"], "{args}");
            assert!(int_in(&o["a"], -99.0, 99.0), "{args}");
            assert!(
                o["b"] == json!(1) || o["b"] == json!(2) || o["b"] == "three",
                "{args}"
            );
        }
        other => panic!("call of an unknown tool {other}: {args}"),
    }
}

fn chat_body(choice: Value, seed: u64) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Bern for 3 days, please."}],
        "tools": openai_tools(),
        "tool_choice": choice,
        "max_tokens": 400,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": seed,
    })
}

/// One choice of a chat reply: its calls (name, arguments), finish reason and content.
type ChatChoice = (Vec<(String, Value)>, String, Value);

/// The choices of a non-streaming chat reply.
fn chat_calls(v: &Value) -> Vec<ChatChoice> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let calls = c["message"]["tool_calls"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|t| {
                            assert!(t["id"].as_str().unwrap().starts_with("call_"), "{t}");
                            let args: Value =
                                serde_json::from_str(t["function"]["arguments"].as_str().unwrap())
                                    .unwrap();
                            (t["function"]["name"].as_str().unwrap().to_string(), args)
                        })
                        .collect()
                })
                .unwrap_or_default();
            (
                calls,
                c["finish_reason"].as_str().unwrap().to_string(),
                c["message"]["content"].clone(),
            )
        })
        .collect()
}

/// The calls, content and finish reason of a streamed chat reply (one choice).
fn stream_calls(r: &Resp) -> (Vec<(String, Value)>, String, String) {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut finish = String::new();
    for c in r.sse_json() {
        assert!(c.get("error").is_none(), "{c}");
        let Some(ch) = c["choices"].get(0) else {
            continue;
        };
        content.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        for t in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(t["index"], calls.len(), "{t}");
            let args: Value =
                serde_json::from_str(t["function"]["arguments"].as_str().unwrap()).unwrap();
            calls.push((t["function"]["name"].as_str().unwrap().to_string(), args));
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (calls, content, finish)
}

/// Every reply of `required` (several seeds and `n`, streaming and not) is only tool calls
/// with valid arguments; `single` also checks that there is exactly one.
async fn required_replies(s: &TestServer, single: bool) {
    let mut finished = 0;
    for seed in [1u64, 2, 3] {
        let mut b = chat_body(json!("required"), seed);
        b["n"] = json!(2);
        if single {
            b["parallel_tool_calls"] = json!(false);
        }
        let r = s.post("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 200, "{}", r.text());
        for (calls, finish, content) in chat_calls(&r.json()) {
            if finish == "length" {
                // Only several calls in a row can outrun 400 tokens.
                assert!(!single, "{calls:?}");
                continue;
            }
            finished += 1;
            assert_eq!(finish, "tool_calls", "{calls:?} {content}");
            assert!(content.is_null(), "{content}");
            assert!(!calls.is_empty());
            if single {
                assert_eq!(calls.len(), 1, "{calls:?}");
            }
            for (name, args) in &calls {
                check_call(name, args);
            }
        }
        // Streaming: choice 0 samples with the same seed, so it is the same reply.
        let mut b = chat_body(json!("required"), seed);
        b["stream"] = json!(true);
        if single {
            b["parallel_tool_calls"] = json!(false);
        }
        let (calls, content, finish) = stream_calls(&s.post("/v1/chat/completions", &b).await);
        if finish != "length" {
            assert_eq!(finish, "tool_calls");
            assert_eq!(content, "");
            assert!(!calls.is_empty());
            for (name, args) in &calls {
                check_call(name, args);
            }
        }
    }
    assert!(finished >= 3, "too few replies finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_required_and_named_give_valid_calls_json_format() {
    let s = start("qwen2-a", Some("qwen2.5.jinja")).await;
    required_replies(&s, true).await;
    required_replies(&s, false).await;
    for name in ["get_weather", "add"] {
        for (seed, stream) in [(4u64, false), (5, true)] {
            let mut b = chat_body(
                json!({"type": "function", "function": {"name": name}}),
                seed,
            );
            b["stream"] = json!(stream);
            let r = s.post("/v1/chat/completions", &b).await;
            let (calls, finish) = if stream {
                let (calls, content, finish) = stream_calls(&r);
                assert_eq!(content, "");
                (calls, finish)
            } else {
                assert_eq!(r.status, 200, "{}", r.text());
                let mut v = chat_calls(&r.json());
                let (calls, finish, _) = v.remove(0);
                (calls, finish)
            };
            assert_eq!(finish, "tool_calls", "{calls:?}");
            assert_eq!(calls.len(), 1, "{calls:?}");
            assert_eq!(calls[0].0, name);
            check_call(&calls[0].0, &calls[0].1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_required_gives_valid_calls_xml_format() {
    // Qwen3.5's template (XML tool calls, reasoning) on the tiny Qwen3.5-MoE model.
    let s = start("qwen35moe-a", Some("qwen3.5.jinja")).await;
    required_replies(&s, true).await;
    let mut b = chat_body(json!({"type": "function", "function": {"name": "add"}}), 9);
    b["stream"] = json!(true);
    let (calls, _, finish) = stream_calls(&s.post("/v1/chat/completions", &b).await);
    assert_eq!(finish, "tool_calls");
    assert_eq!(calls.len(), 1, "{calls:?}");
    check_call(&calls[0].0, &calls[0].1);
    // The template closed the think block (enable_thinking = false): no reasoning.
    let r = s
        .post("/v1/chat/completions", &chat_body(json!("required"), 3))
        .await;
    let v = r.json();
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_none_never_calls() {
    for (model, tpl) in [
        ("qwen2-a", "qwen2.5.jinja"),
        ("qwen35moe-a", "qwen3.5.jinja"),
    ] {
        let s = start(model, Some(tpl)).await;
        for seed in [1u64, 2] {
            let mut b = chat_body(json!("none"), seed);
            b["max_tokens"] = json!(48);
            b["n"] = json!(2);
            let r = s.post("/v1/chat/completions", &b).await;
            assert_eq!(r.status, 200, "{}", r.text());
            for (calls, finish, content) in chat_calls(&r.json()) {
                assert!(calls.is_empty() && finish != "tool_calls", "{calls:?}");
                assert!(!content.as_str().unwrap_or("").contains("<tool_call>"));
            }
            b["stream"] = json!(true);
            b["n"] = json!(1);
            let (calls, content, finish) = stream_calls(&s.post("/v1/chat/completions", &b).await);
            assert!(calls.is_empty() && finish != "tool_calls");
            assert!(!content.contains("<tool_call>"));
        }
        let mut b = json!({"model": "tiny", "max_tokens": 32, "tools": anthropic_tools(),
            "tool_choice": {"type": "none"},
            "messages": [{"role": "user", "content": "Weather in Bern?"}]});
        let r = s.post("/v1/messages", &b).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_ne!(v["stop_reason"], "tool_use", "{v}");
        for block in v["content"].as_array().unwrap() {
            assert_ne!(block["type"], "tool_use", "{v}");
        }
        b["stream"] = json!(true);
        let r = s.post("/v1/messages", &b).await;
        assert!(!r.text().contains("tool_use"), "{}", r.text());
    }
}

/// A reply's tool calls, stop reason and whether it had a text block.
type Calls = (Vec<(String, Value)>, String, bool);

/// The tool calls of a non-streaming Anthropic reply.
fn message_calls(v: &Value) -> Calls {
    let blocks = v["content"].as_array().unwrap();
    let calls = blocks
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| {
            assert!(b["id"].as_str().unwrap().starts_with("toolu_"));
            (b["name"].as_str().unwrap().to_string(), b["input"].clone())
        })
        .collect();
    let text = blocks.iter().any(|b| b["type"] == "text");
    (calls, v["stop_reason"].as_str().unwrap().to_string(), text)
}

/// The tool calls of a streamed Anthropic reply.
fn message_stream_calls(r: &Resp) -> Calls {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut calls = Vec::new();
    let mut stop = String::new();
    let mut text = false;
    for (ev, data) in r.sse() {
        let d: Value = serde_json::from_str(&data).unwrap();
        match ev.as_deref() {
            Some("error") => panic!("{d}"),
            Some("content_block_start") if d["content_block"]["type"] == "tool_use" => {
                calls.push((
                    d["content_block"]["name"].as_str().unwrap().to_string(),
                    Value::Null,
                ));
            }
            Some("content_block_start") => text = true,
            Some("content_block_delta") if d["delta"]["type"] == "input_json_delta" => {
                let args = d["delta"]["partial_json"].as_str().unwrap();
                calls.last_mut().unwrap().1 = serde_json::from_str(args).unwrap();
            }
            Some("message_delta") => stop = d["delta"]["stop_reason"].as_str().unwrap().into(),
            _ => {}
        }
    }
    (calls, stop, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_any_and_tool_give_valid_calls() {
    for (model, tpl) in [
        ("qwen2-a", "qwen2.5.jinja"),
        ("qwen35moe-a", "qwen3.5.jinja"),
    ] {
        let s = start(model, Some(tpl)).await;
        let mut finished = 0;
        for (i, tc) in [
            json!({"type": "any", "disable_parallel_tool_use": true}),
            json!({"type": "any"}),
            json!({"type": "tool", "name": "get_weather"}),
            json!({"type": "tool", "name": "add"}),
        ]
        .into_iter()
        .enumerate()
        {
            for stream in [false, true] {
                let b = json!({"model": "tiny", "max_tokens": 400, "temperature": 1.0,
                    "tools": anthropic_tools(), "tool_choice": tc, "stream": stream,
                    "messages": [{"role": "user", "content": "Weather in Bern?"}]});
                let r = s.post("/v1/messages", &b).await;
                let (calls, stop, text) = if stream {
                    message_stream_calls(&r)
                } else {
                    assert_eq!(r.status, 200, "{}", r.text());
                    message_calls(&r.json())
                };
                if stop == "max_tokens" {
                    // Only `any` without the one-call limit can outrun 400 tokens (the cut
                    // call is then returned as text).
                    assert_eq!(i, 1, "{tc}");
                    continue;
                }
                finished += 1;
                assert_eq!(stop, "tool_use", "{tc}: {calls:?}");
                assert!(!text, "{tc}: {calls:?}");
                assert!(!calls.is_empty());
                if i != 1 {
                    assert_eq!(calls.len(), 1, "{tc}: {calls:?}");
                }
                if let Some(n) = tc.get("name") {
                    assert_eq!(calls[0].0, n.as_str().unwrap());
                }
                for (name, args) in &calls {
                    check_call(name, args);
                }
            }
        }
        assert!(finished >= 6, "{model}: too few replies finished");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tool_choice_is_400() {
    let s = start("qwen2-a", Some("qwen2.5.jinja")).await;
    let unsupported = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]);
    let mut cases = vec![
        chat_body(json!({"type": "function", "function": {"name": "nope"}}), 1),
        chat_body(json!("sometimes"), 1),
        chat_body(json!(7), 1),
        chat_body(json!({"type": "function"}), 1),
    ];
    for tc in [
        json!("required"),
        json!({"type": "function", "function": {"name": "f"}}),
    ] {
        let mut b = chat_body(tc.clone(), 1);
        b.as_object_mut().unwrap().remove("tools");
        cases.push(b);
        // A schema llguidance cannot compile (refused when the request is submitted).
        let mut b = chat_body(tc, 1);
        b["tools"] = unsupported.clone();
        cases.push(b.clone());
        b["stream"] = json!(true);
        cases.push(b);
    }
    for b in cases {
        let r = s.post("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 400, "{b}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["param"], "tool_choice", "{e}");
        assert!(!e["error"]["message"].as_str().unwrap().is_empty());
    }
    let unsupported_a = json!([{"name": "f",
        "input_schema": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}]);
    let msg = |tc: Value, tools: Option<Value>| {
        let mut b = json!({"model": "tiny", "max_tokens": 16, "tool_choice": tc,
            "messages": [{"role": "user", "content": "hi"}]});
        if let Some(t) = tools {
            b["tools"] = t;
        }
        b
    };
    for b in [
        msg(json!({"type": "any"}), None),
        msg(
            json!({"type": "tool", "name": "nope"}),
            Some(anthropic_tools()),
        ),
        msg(json!({"type": "tool"}), Some(anthropic_tools())),
        msg(json!({"type": "sometimes"}), Some(anthropic_tools())),
        msg(json!({"type": "any"}), Some(unsupported_a.clone())),
    ] {
        let r = s.post("/v1/messages", &b).await;
        assert_eq!(r.status, 400, "{b}: {}", r.text());
        let e = r.json();
        assert_eq!(e["type"], "error", "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool_choice"));
    }
    // `auto` and `none` need no tools; the server still works.
    for tc in [json!("auto"), json!("none")] {
        let mut b = chat_body(tc, 1);
        b.as_object_mut().unwrap().remove("tools");
        b["max_tokens"] = json!(4);
        let r = s.post("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // A template without a tool-call format cannot force a call.
    let plain = start("qwen2-a", None).await;
    let r = plain
        .post("/v1/chat/completions", &chat_body(json!("required"), 1))
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "tool_choice");
}

/// The tiny fixtures' tokenizer and its constrained-decoding environment.
fn env() -> (Arc<Tokenizer>, StructuredEnv) {
    let path = repo().join("tests/fixtures/tiny/qwen2-a/tokenizer.json");
    let gen = json!({"eos_token_id": [399, 397]});
    let cfg = json!({"eos_token": "<|im_end|>"});
    let tok = Arc::new(Tokenizer::from_tokenizer_json(&path, Some(&cfg), Some(&gen)).unwrap());
    let env = StructuredEnv::new(tok.clone(), 400).unwrap();
    (tok, env)
}

/// Whether the grammar of `c` accepts `text` as a whole reply.
fn accepts(tok: &Tokenizer, env: &StructuredEnv, c: &Constraint, text: &str) -> bool {
    let mut m = env.compile(c).unwrap_or_else(|e| panic!("{e}: {c:?}"));
    for t in tok.encode(text, false, false).unwrap() {
        if m.consume(t).is_err() {
            return false;
        }
    }
    m.is_accepting()
}

/// Parse a whole reply as the server does (with the tools' parameter types).
fn parse(fmt: ReplyFormat, starts_in_reasoning: bool, text: &str) -> ParsedReply {
    let mut p = ReplyParser::new(fmt, starts_in_reasoning).with_tools(&openai_tools());
    p.push(text);
    p.finish().1
}

fn policy(choice: ToolChoice, single: bool) -> ToolPolicy {
    ToolPolicy { choice, single }
}

#[test]
fn grammars_follow_the_templates() {
    let (tok, env) = env();
    let tools = openai_tools();
    // Qwen2.5: JSON calls, exactly as the template renders them in the history.
    let fmt = ReplyFormat::from_template(&template("qwen2.5.jinja"));
    let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\", \"days\": 3, \"unit\": \"C\"}}\n</tool_call>";
    let two = format!("{one}\n<tool_call>\n{{\"name\": \"add\", \"arguments\": {{\"a\": -5, \"b\": \"three\"}}}}\n</tool_call>");
    let req = tool_choice::constraint(&policy(ToolChoice::Required, false), Some(&tools), fmt, "")
        .unwrap()
        .unwrap();
    assert!(accepts(&tok, &env, &req, one));
    assert!(accepts(&tok, &env, &req, &two));
    let parsed = parse(fmt, false, &two);
    assert_eq!(parsed.tool_calls.len(), 2);
    assert_eq!(parsed.content, "");
    assert_eq!(
        parsed.tool_calls[1].arguments,
        json!({"a": -5, "b": "three"})
    );
    for bad in [
        "Sure! ".to_string() + one,
        one.replace("\"days\": 3", "\"days\": 9"),
        one.replace(", \"unit\": \"C\"", ""),
        one.replace("get_weather", "get_time"),
        one[..one.len() - 1].to_string(),
    ] {
        assert!(!accepts(&tok, &env, &req, &bad), "{bad}");
    }
    let single =
        tool_choice::constraint(&policy(ToolChoice::Required, true), Some(&tools), fmt, "")
            .unwrap()
            .unwrap();
    assert!(accepts(&tok, &env, &single, one));
    assert!(!accepts(&tok, &env, &single, &two));
    let named = tool_choice::constraint(
        &policy(ToolChoice::Function("add".into()), true),
        Some(&tools),
        fmt,
        "",
    )
    .unwrap()
    .unwrap();
    assert!(!accepts(&tok, &env, &named, one));

    // Qwen3.5: XML calls; the prompt opened the think block, which must close first.
    let fmt = ReplyFormat::from_template(&template("qwen3.5.jinja"));
    let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nBad Ragaz\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=unit>\nC\n</parameter>\n<parameter=rain>\nTrue\n</parameter>\n</function>\n</tool_call>";
    let c = tool_choice::constraint(
        &policy(ToolChoice::Required, false),
        Some(&tools),
        fmt,
        "<|im_start|>assistant\n<think>\n",
    )
    .unwrap()
    .unwrap();
    let shorter = call.replace("Bad Ragaz", "Bern");
    let reply = format!("Call it.\n</think>\n\n{shorter}");
    assert!(accepts(&tok, &env, &c, &reply));
    assert!(
        !accepts(&tok, &env, &c, &shorter),
        "the think block must close"
    );
    assert!(
        !accepts(&tok, &env, &c, &format!("x</think>\n\n{call}")),
        "city too long"
    );
    let parsed = parse(fmt, true, &reply);
    assert_eq!(parsed.reasoning.as_deref(), Some("Call it."));
    assert_eq!(parsed.tool_calls.len(), 1);
    assert_eq!(
        parsed.tool_calls[0].arguments,
        json!({"city": "Bern", "days": 3, "unit": "C", "rain": true})
    );
    // Thinking off (the prompt closed the block): the calls come first.
    let closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    let c = tool_choice::constraint(
        &policy(ToolChoice::Required, true),
        Some(&tools),
        fmt,
        closed,
    )
    .unwrap()
    .unwrap();
    assert!(accepts(&tok, &env, &c, &shorter));
    let no_rain = shorter.replace("<parameter=rain>\nTrue\n</parameter>\n", "");
    assert!(accepts(&tok, &env, &c, &no_rain));
    let add = "<tool_call>\n<function=add>\n<parameter=a>\n42\n</parameter>\n<parameter=b>\n\"three\"\n</parameter>\n</function>\n</tool_call>";
    assert!(accepts(&tok, &env, &c, add));
    let parsed = parse(fmt, false, add);
    assert_eq!(
        parsed.tool_calls[0].arguments,
        json!({"a": 42, "b": "three"})
    );
    for bad in [
        shorter.replace("<parameter=unit>\nC\n", "<parameter=unit>\nK\n"),
        shorter.replace("<parameter=days>\n3\n</parameter>\n", ""),
        add.replace("42", "420"),
        add.replace("\"three\"", "three"),
    ] {
        assert!(!accepts(&tok, &env, &c, &bad), "{bad}");
    }

    // Raw string values: `pattern` (search semantics unless anchored) and length together.
    let coded = json!([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["code", "note"], "properties": {
            "code": {"type": "string", "pattern": "^\\d{2}-[A-Z]+$"},
            "note": {"type": "string", "pattern": "ok", "maxLength": 6}}}}}]);
    let c = tool_choice::constraint(
        &policy(ToolChoice::Required, true),
        Some(&coded),
        fmt,
        closed,
    )
    .unwrap()
    .unwrap();
    let f = |code: &str, note: &str| {
        format!("<tool_call>\n<function=f>\n<parameter=code>\n{code}\n</parameter>\n<parameter=note>\n{note}\n</parameter>\n</function>\n</tool_call>")
    };
    assert!(accepts(&tok, &env, &c, &f("42-AB", "is ok")));
    for (code, note) in [
        ("4-AB", "ok"),
        ("42-ab", "ok"),
        ("42-AB", "is ok!!"),
        ("42-AB", "o k"),
    ] {
        assert!(!accepts(&tok, &env, &c, &f(code, note)), "{code} {note}");
    }

    // `none`: text without the opening tag, however it is spelled.
    let none = tool_choice::constraint(&policy(ToolChoice::None, false), Some(&tools), fmt, "")
        .unwrap()
        .unwrap();
    assert!(accepts(
        &tok,
        &env,
        &none,
        "Hello <tool_cal> </tool_call> <think>x</think>"
    ));
    assert!(!accepts(&tok, &env, &none, "Hello <tool_call>"));
    assert!(!accepts(&tok, &env, &none, shorter.as_str()));
}

/// An engine that records the requests it gets and ends each one at once.
#[derive(Default)]
struct Recorder {
    requests: Mutex<Vec<Request>>,
}

/// The events of a recorded request: `Done` and nothing else.
struct DoneAtOnce(bool);

impl EventStream for DoneAtOnce {
    fn recv(&mut self) -> RecvFuture<'_> {
        let first = !std::mem::replace(&mut self.0, true);
        Box::pin(async move {
            first.then(|| Event::Done {
                finish: FinishReason::EndOfGeneration,
                usage: Usage::default(),
                timing: Default::default(),
            })
        })
    }
}

impl Engine for Recorder {
    fn submit(&self, req: Request) -> Result<Box<dyn EventStream>, SubmitError> {
        self.requests.lock().unwrap().push(req);
        Ok(Box::new(DoneAtOnce(false)))
    }
    fn metrics(&self) -> EngineMetrics {
        EngineMetrics::default()
    }
    fn n_ctx(&self) -> usize {
        4096
    }
    fn shutdown(&self) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_carry_the_right_constraint() {
    // Qwen3's template: JSON tool calls and reasoning that `enable_thinking` switches off.
    let (tok, _) = env();
    let rec = Arc::new(Recorder::default());
    let model = ServedModel::new("tiny".into(), tok.clone(), Some(&template("qwen3.jinja")))
        .expect("model");
    let s = TestServer::start(rec.clone(), model, cfg()).await;
    let last = || {
        let r = rec.requests.lock().unwrap();
        let req = r.last().expect("a request").clone();
        let prompt = tok.decode(&req.prompt, false).unwrap();
        (req.constraint, prompt)
    };
    let schema = json!({"type": "object"});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
    let cases = [
        // (tool_choice, response_format, constraint kind, tools in the prompt, thinking off)
        (json!("auto"), None, "none", true, false),
        (json!("none"), None, "ban", false, false),
        (json!("required"), None, "calls", true, true),
        (
            json!({"type": "function", "function": {"name": "add"}}),
            None,
            "add",
            true,
            true,
        ),
        (json!("none"), Some(rf.clone()), "json", false, true),
        (json!("required"), Some(rf.clone()), "calls", true, true),
    ];
    for (tc, rf, kind, shows_tools, no_think) in cases {
        let mut b = chat_body(tc.clone(), 1);
        if let Some(rf) = rf {
            b["response_format"] = rf;
        }
        let r = s.post("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 200, "{tc}: {}", r.text());
        let (c, prompt) = last();
        match (kind, &c) {
            ("none", None) | ("json", Some(Constraint::JsonSchema(_))) => {}
            ("ban", Some(Constraint::Lark(g))) => assert!(g.contains("~/"), "{g}"),
            ("calls", Some(Constraint::Lark(g))) => {
                assert!(g.contains("get_weather") && g.contains("add"), "{g}")
            }
            ("add", Some(Constraint::Lark(g))) => {
                assert!(!g.contains("get_weather") && g.contains("add"), "{g}")
            }
            _ => panic!("{tc}: expected {kind}, got {c:?}"),
        }
        assert_eq!(
            prompt.contains("get_weather"),
            shows_tools,
            "{tc}: {prompt}"
        );
        assert_eq!(
            prompt.ends_with("<think>\n\n</think>\n\n"),
            no_think,
            "{tc}: {prompt}"
        );
    }
    // The client's own `enable_thinking` wins; the grammar then allows a think block first.
    let mut b = chat_body(json!("required"), 1);
    b["chat_template_kwargs"] = json!({"enable_thinking": true});
    assert_eq!(s.post("/v1/chat/completions", &b).await.status, 200);
    match last() {
        (Some(Constraint::Lark(g)), prompt) if !prompt.ends_with("</think>\n\n") => {
            assert!(
                g.starts_with("start: (\"<think>\" think SEP?)? call"),
                "{g}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Anthropic: the same constraints.
    for (tc, kind) in [
        (json!({"type": "any"}), "calls"),
        (json!({"type": "tool", "name": "add"}), "add"),
        (json!({"type": "none"}), "ban"),
        (json!({"type": "auto"}), "none"),
    ] {
        let b = json!({"model": "tiny", "max_tokens": 16, "tools": anthropic_tools(),
            "tool_choice": tc, "messages": [{"role": "user", "content": "hi"}]});
        let r = s.post("/v1/messages", &b).await;
        assert_eq!(r.status, 200, "{tc}: {}", r.text());
        let (c, prompt) = last();
        match (kind, &c) {
            ("none", None) => {}
            ("ban", Some(Constraint::Lark(g))) => assert!(g.contains("~/"), "{g}"),
            ("calls", Some(Constraint::Lark(g))) => assert!(g.contains("get_weather"), "{g}"),
            ("add", Some(Constraint::Lark(g))) => assert!(!g.contains("get_weather"), "{g}"),
            _ => panic!("{tc}: expected {kind}, got {c:?}"),
        }
        assert_eq!(prompt.contains("get_weather"), kind != "ban", "{tc}");
        // count_tokens renders the same prompt.
        let n = s.post("/v1/messages/count_tokens", &b).await.json()["input_tokens"].clone();
        let r = rec.requests.lock().unwrap();
        assert_eq!(n, json!(r.last().unwrap().prompt.len()), "{tc}");
    }
}
