//! Images through every API, over the real engine and the tiny Qwen3.5 vision-language fixture
//! (`tests/fixtures/tiny/qwen35-vl-a`: random weights, a vision tower, a short ChatML template
//! that writes `<|vision_start|><|image_pad|><|vision_end|>` per image): prompt token counts
//! with the images widened, the same greedy reply through the OpenAI and Anthropic endpoints,
//! every class of bad input as a 400 that leaves the server serving, a text-only model's
//! refusal, and image URLs fetched from a local HTTP server when allowed.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use common::{cfg, load_tiny, repo, TestServer};
use kapitsa_engine::{EngineConfig, EngineHandle};
use kapitsa_models::KvType;
use kapitsa_server::images::ImageConfig;
use kapitsa_server::ServerConfig;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn vl() -> PathBuf {
    repo().join("tests/fixtures/tiny/qwen35-vl-a")
}

/// Whether the fixture is there (tests are skipped, with a note, without it).
fn have_fixture() -> bool {
    let ok = vl().join("model.safetensors").exists();
    if !ok {
        eprintln!("skipped: {} is absent", vl().display());
    }
    ok
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(vl().join("images").join(name)).expect("fixture image")
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!("data:{mime};base64,{}", b64(bytes))
}

fn png1() -> String {
    data_url("image/png", &image("img1.png"))
}

fn jpg2() -> String {
    data_url("image/jpeg", &image("img2.jpg"))
}

async fn start_model(model: PathBuf, scfg: ServerConfig) -> TestServer {
    let (opened, served) = load_tiny(&model, None);
    let ecfg = EngineConfig {
        max_running: 4,
        max_batch_tokens: 64,
        n_ctx: 1024,
        max_queue: 16,
        kv_type: KvType::F32,
        vision: opened.vision.clone(),
        ..EngineConfig::default()
    };
    let engine =
        EngineHandle::start(opened.model.clone(), served.tokenizer.clone(), ecfg).expect("engine");
    TestServer::start(Arc::new(engine), served, scfg).await
}

async fn start(scfg: ServerConfig) -> TestServer {
    start_model(vl(), scfg).await
}

/// An OpenAI chat body: one user message of `parts`, greedy, `max_tokens` 8.
fn openai(parts: Value) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 8,
        "temperature": 0,
    })
}

fn image_url(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url, "detail": "auto"}})
}

fn text(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

/// Prompt tokens the server should report for a user message of `pieces` (`None` = an image
/// with those bytes): the rendered prompt's tokens, each image token widened to the image's
/// tokens.
fn expected_prompt_tokens(st: &kapitsa_server::AppState, pieces: &[Result<&str, &[u8]>]) -> usize {
    let items: Vec<Value> = pieces
        .iter()
        .map(|p| match p {
            Ok(t) => text(t),
            Err(_) => json!({"type": "image"}),
        })
        .collect();
    let msgs = json!([{"role": "user", "content": items}]);
    let rendered = st
        .model
        .template
        .as_ref()
        .expect("template")
        .render(&msgs, None, true, None)
        .expect("render");
    let n_img = pieces.iter().filter(|p| p.is_err()).count();
    assert_eq!(
        rendered
            .matches(kapitsa_server::images::IMAGE_PLACEHOLDER)
            .count(),
        n_img,
        "{rendered}"
    );
    let ids = st
        .model
        .tokenizer
        .encode(&rendered, true, true)
        .expect("encode");
    let proc = st.model.image_processor.clone().expect("image processor");
    let mut n = ids.len();
    for p in pieces {
        if let Err(bytes) = p {
            let px = proc.preprocess(bytes, &Default::default()).expect("px");
            n = n + px.n_tokens(proc.cut().2) - 1;
        }
    }
    n
}

fn reply_text(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_and_two_images_count_their_tokens() {
    if !have_fixture() {
        return;
    }
    let srv = start(cfg()).await;
    let (p1, j2) = (image("img1.png"), image("img2.jpg"));
    let r = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([
                text("Look at the picture: "),
                image_url(&png1()),
                text(" What is in it?")
            ])),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let want = expected_prompt_tokens(
        &srv.state,
        &[Ok("Look at the picture: "), Err(&p1), Ok(" What is in it?")],
    );
    assert_eq!(v["usage"]["prompt_tokens"], want, "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );

    let r = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([
                text("Compare "),
                image_url(&png1()),
                text(" with the second one "),
                image_url(&jpg2()),
                text(" and say which is brighter.")
            ])),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let want2 = expected_prompt_tokens(
        &srv.state,
        &[
            Ok("Compare "),
            Err(&p1),
            Ok(" with the second one "),
            Err(&j2),
            Ok(" and say which is brighter."),
        ],
    );
    assert_eq!(r.json()["usage"]["prompt_tokens"], want2);

    // Streaming reports the same count.
    let mut body = openai(json!([
        text("Look at the picture: "),
        image_url(&png1()),
        text(" What is in it?")
    ]));
    body["stream"] = true.into();
    body["stream_options"] = json!({"include_usage": true});
    let r = srv.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let usage = r
        .sse_json()
        .into_iter()
        .find(|c| c["usage"].is_object())
        .expect("usage chunk");
    assert_eq!(usage["usage"]["prompt_tokens"], want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_anthropic_responses_and_ollama_agree() {
    if !have_fixture() {
        return;
    }
    let srv = start(cfg()).await;
    let bytes = image("img1.png");
    let o = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([image_url(&png1()), text("Describe it.")])),
        )
        .await;
    assert_eq!(o.status, 200, "{}", o.text());
    let o = o.json();
    let a = srv
        .post(
            "/v1/messages",
            &json!({
                "model": "tiny",
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&bytes)}},
                    {"type": "text", "text": "Describe it."}
                ]}]
            }),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let a = a.json();
    assert_eq!(
        a["usage"]["input_tokens"], o["usage"]["prompt_tokens"],
        "{a}"
    );
    let a_text: String = a["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(
        a_text,
        reply_text(&o),
        "the same greedy reply through both APIs"
    );

    let c = srv
        .post(
            "/v1/messages/count_tokens",
            &json!({"model": "tiny", "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&bytes)}},
                {"type": "text", "text": "Describe it."}
            ]}]}),
        )
        .await;
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(c.json()["input_tokens"], o["usage"]["prompt_tokens"]);

    let r = srv
        .post(
            "/v1/responses",
            &json!({
                "model": "tiny", "max_output_tokens": 8, "temperature": 0,
                "input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": png1()},
                    {"type": "input_text", "text": "Describe it."}
                ]}]
            }),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = r.json();
    assert_eq!(
        r["usage"]["input_tokens"], o["usage"]["prompt_tokens"],
        "{r}"
    );

    let l = srv
        .post(
            "/api/chat",
            &json!({
                "model": "tiny", "stream": false,
                "options": {"temperature": 0, "num_predict": 8},
                "messages": [{"role": "user", "content": "Describe it.", "images": [b64(&bytes)]}]
            }),
        )
        .await;
    assert_eq!(l.status, 200, "{}", l.text());
    let l = l.json();
    assert_eq!(l["prompt_eval_count"], o["usage"]["prompt_tokens"], "{l}");
    assert_eq!(
        l["message"]["content"].as_str(),
        Some(reply_text(&o).as_str())
    );
}

/// A server whose limits the bad-input test can reach with the fixture images: 7000 bytes
/// (img1.png is 7968, img2.jpg 3497) and 2 images per request.
fn small_limits() -> ServerConfig {
    let mut c = cfg();
    c.images = ImageConfig {
        max_images: 2,
        limits: kapitsa_image::Limits {
            max_bytes: 7000,
            max_pixels: 40_000_000,
        },
        ..ImageConfig::default()
    };
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_are_400s_and_the_server_goes_on() {
    if !have_fixture() {
        return;
    }
    let srv = start(small_limits()).await;
    let fx = |n: &str| std::fs::read(repo().join("tests/fixtures/images").join(n)).expect("img");
    let png = image("img1.png");
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "corrupt",
            image_url(&data_url("image/jpeg", &image("img2.jpg")[..600])),
            "invalid image",
        ),
        (
            "unsupported BMP",
            image_url(&data_url("image/bmp", &fx("bad_valid.bmp"))),
            "unsupported image",
        ),
        (
            "unsupported TIFF",
            image_url(&data_url("image/tiff", &fx("bad_valid.tiff"))),
            "unsupported image",
        ),
        (
            "too many bytes",
            image_url(&data_url("image/png", &png)),
            "over the limit of 7000 bytes",
        ),
        (
            "too many pixels",
            image_url(&data_url("image/png", &fx("bad_huge_100000x100000.png"))),
            "over the limit of 40000000 pixels",
        ),
        (
            "URL without the flag",
            image_url("http://127.0.0.1:9/cat.png"),
            "--allow-image-urls",
        ),
        (
            "bad base64",
            image_url("data:image/png;base64,@@@not base64@@@"),
            "not valid base64",
        ),
        (
            "not an image data URL",
            image_url("data:text/plain;base64,aGk="),
            "not an image type",
        ),
        (
            "neither data nor http",
            image_url("file:///etc/passwd"),
            "neither a data: URL",
        ),
    ];
    for (what, part, msg) in cases {
        let r = srv
            .post("/v1/chat/completions", &openai(json!([part, text("hi")])))
            .await;
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let v = r.json();
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(msg), "{what}: {m}");
        assert_eq!(v["error"]["param"], "messages[0].content[0]", "{what}: {v}");
        let ok = srv
            .post(
                "/v1/chat/completions",
                &openai(json!([image_url(&jpg2()), text("hi")])),
            )
            .await;
        assert_eq!(ok.status, 200, "after {what}: {}", ok.text());
    }
    // Too many images.
    let j = jpg2();
    let r = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([image_url(&j), image_url(&j), image_url(&j)])),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("over the limit of 2 per request"),
        "{}",
        r.text()
    );
    // Images outside user messages.
    let r = srv
        .post(
            "/v1/chat/completions",
            &json!({"model": "tiny", "max_tokens": 4, "messages": [
                {"role": "system", "content": [image_url(&j)]},
                {"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("only accepted in user messages"),
        "{}",
        r.text()
    );
    // Anthropic: its error shape.
    let r = srv
        .post(
            "/v1/messages",
            &json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}
            ]}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("invalid base64"),
        "{v}"
    );
    let r = srv
        .post(
            "/v1/messages",
            &json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
            ]}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("image URLs are disabled"), "{}", r.text());
    // Ollama.
    let r = srv
        .post(
            "/api/chat",
            &json!({"model": "tiny", "stream": false, "messages": [
                {"role": "user", "content": "hi", "images": ["AAAA"]}]}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let ok = srv
        .post(
            "/v1/chat/completions",
            &json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "plain text"}]}),
        )
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_only_model_refuses_images() {
    let text_only = repo().join("tests/fixtures/tiny/qwen35-a");
    if !have_fixture() || !text_only.exists() {
        return;
    }
    let srv = start_model(text_only, cfg()).await;
    let r = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([image_url(&jpg2()), text("hi")])),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.text()
            .contains("this model has no vision tower: it cannot take images"),
        "{}",
        r.text()
    );
    let r = srv
        .post(
            "/v1/messages",
            &json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64(&image("img2.jpg"))}}
            ]}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("no vision tower"), "{}", r.text());
    let ok = srv
        .post("/v1/chat/completions", &openai(json!("hello")))
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
}

/// A one-shot-per-connection HTTP server on 127.0.0.1: `/img2.jpg` is the fixture JPEG,
/// `/big` is 100 KB, anything else 404.
async fn image_host() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let jpg = image("img2.jpg");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let jpg = jpg.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&got).into_owned();
                let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                let (status, body) = match path.as_str() {
                    "/img2.jpg" => ("200 OK", jpg),
                    "/big" => ("200 OK", vec![0u8; 100_000]),
                    _ => ("404 Not Found", b"nope".to_vec()),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: image/jpeg\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.write_all(&body).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_urls_are_fetched_when_allowed() {
    if !have_fixture() {
        return;
    }
    let host = image_host().await;
    let mut c = small_limits();
    c.images.allow_urls = true;
    let srv = start(c).await;
    let inline = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([image_url(&jpg2()), text("What is it?")])),
        )
        .await;
    assert_eq!(inline.status, 200, "{}", inline.text());
    let fetched = srv
        .post(
            "/v1/chat/completions",
            &openai(json!([
                image_url(&format!("http://{host}/img2.jpg")),
                text("What is it?")
            ])),
        )
        .await;
    assert_eq!(fetched.status, 200, "{}", fetched.text());
    let (a, b) = (inline.json(), fetched.json());
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    // The same image bytes: the prefix cache reuses the first request's image tokens.
    assert!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{b}"
    );
    assert_eq!(reply_text(&a), reply_text(&b));
    for (path, msg) in [
        ("/missing.png", "HTTP status 404"),
        ("/big", "larger than the limit of 7000 bytes"),
    ] {
        let r = srv
            .post(
                "/v1/chat/completions",
                &openai(json!([
                    image_url(&format!("http://{host}{path}")),
                    text("hi")
                ])),
            )
            .await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(r.text().contains(msg), "{path}: {}", r.text());
    }
}

/// Nemotron's omni fixture (`tests/fixtures/tiny/nemotronh-vl-a`: a RADIO tower, its own
/// image processor, `<image>` in the template and `<img>` ... `</img>` around the widened
/// tokens): prompt A of its reference through the OpenAI endpoint gives transformers' prompt
/// length and greedy reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemotron_images_give_the_reference_reply() {
    let dir = repo().join("tests/fixtures/tiny/nemotronh-vl-a");
    if !dir.join("model.safetensors").exists() {
        eprintln!("skipped: {} is absent", dir.display());
        return;
    }
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_vl.json")).unwrap())
            .unwrap();
    let p = &r["prompts"][0];
    let png = std::fs::read(dir.join("images/img1.png")).unwrap();
    let want: Vec<u32> = p["hf_greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let srv = start_model(dir, cfg()).await;
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": [
            text("Look at the picture: "),
            image_url(&data_url("image/png", &png)),
            text(" What is in it?"),
        ]}],
        "max_tokens": want.len(),
        "temperature": 0,
    });
    let resp = srv.post("/v1/chat/completions", &body).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["usage"]["prompt_tokens"], p["n_tokens"], "{v}");
    let reply = srv
        .state
        .model
        .tokenizer
        .decode(&want, true)
        .expect("decode");
    assert_eq!(reply_text(&v), reply);
    srv.shutdown(std::time::Duration::from_secs(5))
        .await
        .unwrap();
}
