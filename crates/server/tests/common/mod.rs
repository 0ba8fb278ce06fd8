//! Shared test helpers: an in-process server on an ephemeral port and a raw HTTP/1.1 client
//! over `tokio::net::TcpStream`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kapitsa_server::engine::Engine;
use kapitsa_server::{AppState, ServedModel, Server, ServerConfig};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny HF fixture.
pub fn tiny() -> PathBuf {
    repo().join("tests/fixtures/tiny/qwen2-a")
}

/// `model` opened as `kapitsa serve` opens it (one thread, served as "tiny", weights as the
/// default load mode picks), with an optional chat template file.
pub fn load_tiny(
    model: &std::path::Path,
    template: Option<&std::path::Path>,
) -> (kapitsa_engine::OpenedModel, ServedModel) {
    let opts = kapitsa_engine::OpenOptions {
        threads: 1,
        chat_template_file: template,
        ..Default::default()
    };
    let opened = kapitsa_engine::open_model(model, &opts).expect("load");
    let served = ServedModel::from_opened(&opened, Some("tiny".into())).expect("served model");
    (opened, served)
}

/// A template from `tests/fixtures/templates`.
pub fn template(name: &str) -> String {
    std::fs::read_to_string(repo().join("tests/fixtures/templates").join(name)).expect("template")
}

/// A running test server.
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state (metrics, engine).
    pub state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    join: Option<JoinHandle<std::io::Result<()>>>,
}

impl TestServer {
    /// Serve `model` on `engine` on 127.0.0.1:0.
    pub async fn start(
        engine: Arc<dyn Engine>,
        model: ServedModel,
        cfg: ServerConfig,
    ) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = Server::new(engine, model, cfg);
        let state = server.state();
        let (tx, rx) = oneshot::channel::<()>();
        let join = tokio::spawn(server.run(listener, async move {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            state,
            stop: Some(tx),
            join: Some(join),
        }
    }

    /// Trigger a graceful shutdown (does not wait).
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    /// Shut down and wait for `run` to return (at most `limit`).
    pub async fn shutdown(mut self, limit: Duration) -> std::io::Result<()> {
        self.begin_shutdown();
        let join = self.join.take().expect("running");
        tokio::time::timeout(limit, join)
            .await
            .expect("the server did not stop in time")
            .expect("server task")
    }

    /// Send a request and read the whole response.
    pub async fn req(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Resp {
        request(self.addr, method, path, headers, body).await
    }

    /// POST a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> Resp {
        self.req("POST", path, &[], body.to_string().as_bytes())
            .await
    }

    /// GET.
    pub async fn get(&self, path: &str) -> Resp {
        self.req("GET", path, &[], b"").await
    }

    /// The value of a Prometheus metric (first sample whose line starts with `name`).
    pub async fn metric(&self, name: &str) -> f64 {
        let r = self.get("/metrics").await;
        let text = r.text();
        text.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} not found in\n{text}"))
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}

/// A response.
#[derive(Debug)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Headers (names lower-cased).
    pub headers: Vec<(String, String)>,
    /// Body (de-chunked).
    pub body: Vec<u8>,
}

impl Resp {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): status {} {}", self.status, self.text()))
    }

    /// A header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// SSE events: (event name, data), in order.
    pub fn sse(&self) -> Vec<(Option<String>, String)> {
        parse_sse(&self.text())
    }

    /// The JSON `data` of SSE events, up to (not including) `[DONE]`.
    pub fn sse_json(&self) -> Vec<Value> {
        self.sse()
            .into_iter()
            .take_while(|(_, d)| d != "[DONE]")
            .map(|(_, d)| {
                serde_json::from_str(&d).unwrap_or_else(|e| panic!("bad SSE data {d}: {e}"))
            })
            .collect()
    }
}

/// Parse an SSE body into (event, data) pairs; comment lines are skipped.
pub fn parse_sse(text: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut ev = None;
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(e) = line.strip_prefix("event:") {
                ev = Some(e.trim().to_string());
            } else if let Some(d) = line.strip_prefix("data:") {
                data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
            }
        }
        if !data.is_empty() {
            out.push((ev, data.join("\n")));
        }
    }
    out
}

/// Write a request (with `Connection: close`) on a new connection.
pub async fn send_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.expect("write head");
    // A server may answer (413) before reading the whole body; ignore write errors then.
    let _ = s.write_all(body).await;
    s
}

/// One request, whole response.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut s = send_request(addr, method, path, headers, body).await;
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(120), async {
        let mut buf = [0u8; 16384];
        loop {
            match s.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                // A reset after the full response (413 before the body was read) is fine.
                Err(_) => break,
            }
        }
    })
    .await;
    assert!(read.is_ok(), "response to {method} {path} timed out");
    parse_response(&raw)
}

/// Parse a raw HTTP/1.1 response.
pub fn parse_response(raw: &[u8]) -> Resp {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Resp {
        status,
        headers,
        body,
    }
}

/// Decode a chunked body (tolerates a missing final chunk).
pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size_str = String::from_utf8_lossy(&b[..nl]);
        let size_str = size_str.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_str, 16) else {
            break;
        };
        b = &b[nl + 2..];
        if size == 0 || b.len() < size {
            out.extend_from_slice(&b[..size.min(b.len())]);
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[(size + 2).min(b.len())..];
    }
    out
}

/// Wait until `f` returns true (polling every 20 ms), at most `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Default test settings.
pub fn cfg() -> ServerConfig {
    ServerConfig {
        shutdown_grace: Duration::from_secs(5),
        ..Default::default()
    }
}
