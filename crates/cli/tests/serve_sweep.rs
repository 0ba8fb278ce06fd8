//! A malformed-request sweep against a real `kapitsa serve` process on 127.0.0.1 (tiny Qwen2
//! fixture): deep nesting, huge numbers, wrong types, invalid UTF-8 (body and URL), huge
//! strings and arrays, absurd `n` / `max_tokens` / `logit_bias`, on the OpenAI and Anthropic
//! endpoints. Every request must get a 4xx in its API's own error shape within a bounded time,
//! and the server must then still serve a normal request.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::s;
use serde_json::{json, Value};

/// A `kapitsa serve` process, killed on drop.
struct Serve {
    child: Child,
    addr: String,
}

impl Serve {
    fn start(model: &Path) -> Serve {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kapitsa"))
            .args([
                "serve",
                "-m",
                s(model),
                "--port",
                "0",
                "-t",
                "1",
                "-c",
                "512",
            ])
            .args([
                "--max-running",
                "2",
                "--max-queue",
                "4",
                "--model-name",
                "m",
                // a wrong (here: huge) model name must stay an error
                "--strict-model-name",
            ])
            .args(["--max-body-bytes", "8MiB"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning kapitsa serve");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("on http://") {
                    let _ = tx.send(line[i + "on http://".len()..].trim().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("kapitsa serve did not print its address");
        Serve { child, addr }
    }

    /// Send one raw request; (status, body).
    fn send(&self, method: &str, path: &[u8], body: &[u8]) -> (u16, Vec<u8>) {
        let t0 = Instant::now();
        let mut conn = loop {
            match TcpStream::connect(&self.addr) {
                Ok(c) => break c,
                Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("connecting to {}: {e}", self.addr),
            }
        };
        conn.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut req = Vec::new();
        req.extend_from_slice(method.as_bytes());
        req.push(b' ');
        req.extend_from_slice(path);
        req.extend_from_slice(
            format!(
                " HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                self.addr,
                body.len()
            )
            .as_bytes(),
        );
        req.extend_from_slice(body);
        conn.write_all(&req).expect("sending");
        let mut resp = Vec::new();
        conn.read_to_end(&mut resp).expect("reading the answer");
        let split = resp
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("an HTTP answer");
        let head = String::from_utf8_lossy(&resp[..split]).to_string();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head}"));
        let mut body = resp[split + 4..].to_vec();
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            body = dechunk(&body);
        }
        (status, body)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The payload of a chunked HTTP body.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

const CHAT: &[u8] = b"/v1/chat/completions";
const COMPLETIONS: &[u8] = b"/v1/completions";
const MESSAGES: &[u8] = b"/v1/messages";
const COUNT: &[u8] = b"/v1/messages/count_tokens";

fn deep(depth: usize, open: &str, close: &str, inner: &str) -> String {
    format!("{}{inner}{}", open.repeat(depth), close.repeat(depth))
}

/// `base` with top-level `key` set to the raw JSON text `raw`.
fn with_raw(base: &Value, key: &str, raw: &str) -> Vec<u8> {
    let mut b = base.clone();
    b[key] = json!("__RAW__");
    b.to_string().replace("\"__RAW__\"", raw).into_bytes()
}

/// The malformed requests: (name, path, body).
fn cases() -> Vec<(String, &'static [u8], Vec<u8>)> {
    let chat =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let comp = json!({"model": "m", "prompt": "hi", "max_tokens": 2});
    let msgs =
        json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let count = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let mut v: Vec<(String, &'static [u8], Vec<u8>)> = Vec::new();
    let big = "x".repeat(6 << 20);
    let deep_arr = deep(100_000, "[", "]", "1");
    let deep_obj = deep(100_000, "{\"a\":", "}", "1");
    let deep_schema = deep(5_000, "{\"type\":\"array\",\"items\":", "}", "{}");
    for (path, base) in [
        (CHAT, &chat),
        (COMPLETIONS, &comp),
        (MESSAGES, &msgs),
        (COUNT, &count),
    ] {
        let p = String::from_utf8_lossy(path).to_string();
        let mut add = |name: &str, body: Vec<u8>| v.push((format!("{p}: {name}"), path, body));
        // Whole-body damage.
        add("deep array body", deep_arr.clone().into_bytes());
        add("deep object body", deep_obj.clone().into_bytes());
        add(
            "invalid UTF-8 body",
            b"{\"model\": \"m\xff\xfe\", \"x\": \"\xc0\xaf\"}".to_vec(),
        );
        add("truncated", base.to_string().as_bytes()[..10].to_vec());
        add("not an object", b"[1, 2, 3]".to_vec());
        add("number body", b"1e999999".to_vec());
        add("NUL bytes", b"\0\0\0\0".to_vec());
        // Per field.
        let fields: &[&str] = match path {
            CHAT => &[
                "messages",
                "model",
                "max_tokens",
                "temperature",
                "tools",
                "stop",
                "n",
                "top_p",
            ],
            COMPLETIONS => &[
                "prompt",
                "model",
                "max_tokens",
                "temperature",
                "stop",
                "n",
                "logprobs",
                "echo",
            ],
            MESSAGES => &[
                "messages",
                "model",
                "max_tokens",
                "temperature",
                "tools",
                "stop_sequences",
                "top_k",
                "system",
            ],
            _ => &["messages", "model", "tools", "system"],
        };
        for f in fields {
            for (what, raw) in [
                ("deep array", deep(100_000, "[", "]", "1")),
                ("deep object", deep(2_000, "{\"a\":", "}", "1")),
                ("huge number", "1e400".to_string()),
                ("huge integer", "123456789012345678901234567890".to_string()),
                ("negative huge", "-1.7e308".to_string()),
                ("wrong type object", "{\"x\": [true, null]}".to_string()),
                ("wrong type bool", "true".to_string()),
                ("lone surrogate", "\"\\ud800\"".to_string()),
                ("huge array", format!("[{}0]", "0,".repeat(200_000))),
            ] {
                // `echo` is a boolean: give it a string instead.
                let raw = if *f == "echo" && raw == "true" {
                    "\"yes\"".to_string()
                } else {
                    raw
                };
                add(&format!("{f}: {what}"), with_raw(base, f, &raw));
            }
        }
        add(
            "huge string content",
            with_raw(base, "model", &format!("\"{big}\"")),
        );
    }
    // Absurd generation parameters (with otherwise good requests).
    for (key, raw) in [
        ("n", "1000"),
        ("n", "1e20"),
        ("max_tokens", "9223372036854775807"),
        ("max_tokens", "18446744073709551616"),
        ("max_tokens", "-1"),
        ("max_tokens", "1.5"),
        ("logit_bias", "{\"1\": 1e308}"),
        ("logit_bias", "{\"99999999999999999999\": 1}"),
        ("logit_bias", "{\"-1\": 1}"),
        ("logit_bias", "{\"x\": 1}"),
        ("seed", "1e40"),
        ("top_logprobs", "100000"),
        ("temperature", "\"hot\""),
        ("stop", "[1, 2]"),
        ("response_format", "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", \"schema\": {\"$ref\": \"#\"}}}"),
        ("response_format", &format!("{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": \"x\", \"schema\": {deep_schema}}}}}")),
        ("tools", &format!("[{}]", vec!["{\"type\": \"function\", \"function\": {\"name\": 5}}"; 10_000].join(","))),
    ] {
        v.push((format!("chat: {key} = {}", &raw[..raw.len().min(60)]), CHAT, with_raw(&chat, key, raw)));
    }
    let big_logit_bias: String = format!(
        "{{{}}}",
        (0..100_000)
            .map(|i| format!("\"{i}\": 1"))
            .collect::<Vec<_>>()
            .join(",")
    );
    v.push((
        "chat: 100,000 logit_bias entries".into(),
        CHAT,
        with_raw(&chat, "logit_bias", &big_logit_bias),
    ));
    let many_prompts = format!("[{}]", vec!["\"a\""; 10_000].join(","));
    v.push((
        "completions: 10,000 prompts".into(),
        COMPLETIONS,
        with_raw(&comp, "prompt", &many_prompts),
    ));
    v.push((
        "completions: 100,000 stops".into(),
        COMPLETIONS,
        with_raw(
            &comp,
            "stop",
            &format!("[{}]", vec!["\"s\""; 100_000].join(",")),
        ),
    ));
    v.push((
        "completions: prompt ids out of range".into(),
        COMPLETIONS,
        with_raw(&comp, "prompt", "[[4294967295, 1e10]]"),
    ));
    for (key, raw) in [
        ("max_tokens", "1000000000000"),
        ("thinking", "{\"type\": \"enabled\", \"budget_tokens\": 1e300}"),
        ("top_k", "-5"),
        ("system", "[{\"type\": \"image\"}]"),
        ("messages", "[{\"role\": \"user\", \"content\": [{\"type\": \"tool_result\", \"content\": [[[[]]]]}]}]"),
        ("tool_choice", "{\"type\": \"tool\", \"name\": 7}"),
    ] {
        v.push((format!("messages: {key} = {}", &raw[..raw.len().min(60)]), MESSAGES, with_raw(&msgs, key, raw)));
    }
    v
}

/// Check that `body` is an error in the shape of `path`'s API.
fn check_shape(name: &str, path: &[u8], status: u16, body: &[u8]) {
    assert!(
        (400..500).contains(&status),
        "{name}: status {status}: {}",
        String::from_utf8_lossy(&body[..body.len().min(300)])
    );
    let v: Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "{name}: {status} answer is not JSON ({e}): {:?}",
            String::from_utf8_lossy(body)
        )
    });
    if path.starts_with(MESSAGES) {
        assert_eq!(v["type"], "error", "{name}: {v}");
        assert!(v["error"]["type"].is_string(), "{name}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}: {v}"
        );
    } else {
        assert!(v["error"]["type"].is_string(), "{name}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}: {v}"
        );
        assert!(
            v["error"].get("param").is_some() && v["error"].get("code").is_some(),
            "{name}: {v}"
        );
    }
}

#[test]
fn malformed_requests_get_4xx_in_the_api_shape_and_the_server_lives_on() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen2-a");
    let server = Serve::start(&model);
    let started = Instant::now();
    let cases = cases();
    for (name, path, body) in &cases {
        let t0 = Instant::now();
        let (status, answer) = server.send("POST", path, body);
        check_shape(name, path, status, &answer);
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{name} took {:?}",
            t0.elapsed()
        );
    }
    // URLs: model ids that are not UTF-8 or absurdly long, unknown routes, bad methods. (A
    // request line past 64 KiB never reaches the server: hyper answers 414 with no body.)
    let long_id = format!("/v1/models/{}", "a".repeat(50_000));
    for (method, path) in [
        ("GET", b"/v1/models/%FF%FE%80".to_vec()),
        ("GET", b"/v1/models/%C0%AF".to_vec()),
        ("GET", long_id.into_bytes()),
        ("GET", b"/v1/models/%".to_vec()),
        ("GET", b"/v1/%FF%FF/completions".to_vec()),
        ("DELETE", CHAT.to_vec()),
    ] {
        let name = format!(
            "{method} {}",
            String::from_utf8_lossy(&path[..path.len().min(60)])
        );
        let (status, answer) = server.send(method, &path, b"");
        check_shape(&name, &path, status, &answer);
    }
    eprintln!(
        "{} malformed requests answered in {:?}",
        cases.len() + 6,
        started.elapsed()
    );
    // The server still serves.
    for (path, body) in [
        (
            CHAT,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ),
        (
            COMPLETIONS,
            json!({"model": "m", "prompt": "Once", "max_tokens": 3}),
        ),
        (
            MESSAGES,
            json!({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let (status, answer) = server.send("POST", path, body.to_string().as_bytes());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    }
}
