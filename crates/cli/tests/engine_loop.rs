//! `run` and `chat` decode through the engine service (the server's decode loop), and every
//! model command takes `--device`:
//! - `run` prints byte for byte what the former single-sequence loop (`generate.rs`, removed)
//!   printed, recorded here for the committed tiny fixtures (greedy, sampled, penalties, a stop
//!   string, `--ignore-eos`, attention-only, hybrid and MoE models);
//! - `run` prints what `kapitsa serve` answers on `/v1/completions` for the same request;
//! - a chat's second turn reuses the first turn's tokens from the prefix cache;
//! - `--device cuda` in this build is one clean error line, `--device bogus` a clear error.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const PROMPT: &str = "def add(a, b):";

/// `kapitsa run` of [`PROMPT`] on the tiny fixture `model` with `args`.
fn run_fixture(model: &str, args: &[&str]) -> Out {
    let dir = fixture(model);
    let mut all = vec!["run", "-m", s(&dir), "-p", PROMPT, "-t", "1"];
    all.extend_from_slice(args);
    assert_ok(kapitsa(&all))
}

/// Stdout of the former `generate.rs` loop (the binary of commit 3b36af1), as hex, with the
/// generated token count and the finish reason of its speed line.
#[test]
fn run_prints_what_the_former_loop_printed() {
    let cases: &[(&str, &[&str], &str, usize, &str)] = &[
        (
            "qwen2-a",
            &["-n", "16", "--temp", "0"],
            "207873efbfbd616765736f6465efbfbd6f6465efbfbd717563506974efbfbd2071752072657475726e20280a",
            16,
            "Length",
        ),
        (
            "qwen2-a",
            &["-n", "16", "--temp", "0.8", "--seed", "7"],
            "20632072657475726e286eefbfbdefbfbd65657220696eefbfbdefbfbd203defbfbdefbfbd6865726eefbfbd0a",
            16,
            "Length",
        ),
        (
            "qwen2-a",
            &["-n", "40", "--temp", "0", "--stop", "return"],
            "207873efbfbd616765736f6465efbfbd6f6465efbfbd717563506974efbfbd207175200a",
            15,
            "StopString",
        ),
        (
            "qwen2-a",
            &["-n", "40", "--temp", "0", "--ignore-eos"],
            "207873efbfbd616765736f6465efbfbd6f6465efbfbd717563506974efbfbd2071752072657475726e2028efbfbd72efbfbd286e26efbfbd6a57202b17efbfbd616765efbfbd443c6573202b13efbfbdefbfbd50efbfbd636f0a",
            40,
            "Length",
        ),
        (
            "qwen35moe-a",
            &["-n", "16", "--temp", "0"],
            "6f74efbfbdefbfbd3911efbfbd67efbfbd206c65744b286e1972696e7465795c390a",
            16,
            "Length",
        ),
        (
            "qwen35moe-a",
            &["-n", "16", "--temp", "0.8", "--seed", "7"],
            "2e636fefbfbd2e6673756d76656465efbfbd6f75082071756e293b0a73656c66c6990a",
            16,
            "Length",
        ),
        (
            "nemotronh-moe-a",
            &["-n", "16", "--temp", "0"],
            "542e0a222cefbfbd7073297d7836efbfbd4928293b0a01efbfbd43240a",
            16,
            "Length",
        ),
        (
            "nemotronh-moe-a",
            &["-n", "16", "--temp", "0.8", "--seed", "7", "--repeat-penalty", "1.3"],
            "696f6e7defbfbd65647d0a0ad1802072657475726e2e0aefbfbd656c661969efbfbdefbfbd202074750a",
            16,
            "Length",
        ),
        (
            "qwen3moe-a",
            &["-n", "16", "--temp", "0"],
            "efbfbd3defbfbd3defbfbdefbfbdefbfbd293a0a206120612061efbfbd20646566efbfbdefbfbd206465660a",
            16,
            "Length",
        ),
    ];
    for (model, args, want, n_gen, stop) in cases {
        let o = run_fixture(model, args);
        assert_eq!(hex(o.stdout.as_bytes()), *want, "{model} {args:?}: {o:?}");
        assert!(
            o.stderr.contains("prompt: 10 tokens"),
            "{model} {args:?}: {o:?}"
        );
        assert!(
            o.stderr.contains(&format!("generation: {n_gen} tokens")),
            "{model} {args:?}: {o:?}"
        );
        assert!(
            o.stderr.contains(&format!("stop: {stop}")),
            "{model} {args:?}: {o:?}"
        );
    }
}

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
                "256",
            ])
            .args(["--max-running", "2", "--model-name", "m"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning kapitsa serve");
        let stderr = child.stderr.take().unwrap();
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

    /// POST `body` to `path`; the response's JSON body (status 200 required).
    fn post(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let body = body.to_string();
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
        conn.set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        write!(
            conn,
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut resp = Vec::new();
        conn.read_to_end(&mut resp).unwrap();
        let resp = String::from_utf8(resp).expect("UTF-8 response");
        let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{resp}");
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The same greedy and seeded requests through `kapitsa run` and `kapitsa serve`'s
/// `/v1/completions` give the same text and token counts.
#[test]
fn run_prints_what_the_server_answers() {
    for model in ["qwen2-a", "qwen35moe-a"] {
        let server = Serve::start(&fixture(model));
        let cases: &[(&[&str], serde_json::Value)] = &[
            (
                &["-n", "12", "--temp", "0"],
                serde_json::json!({"max_tokens": 12, "temperature": 0}),
            ),
            (
                &["-n", "12", "--temp", "0.8", "--seed", "7"],
                serde_json::json!({"max_tokens": 12, "temperature": 0.8, "top_k": 40,
                    "top_p": 0.95, "min_p": 0.05, "seed": 7}),
            ),
            (
                &[
                    "-n",
                    "30",
                    "--temp",
                    "0",
                    "--stop",
                    "return",
                    "--ignore-eos",
                ],
                serde_json::json!({"max_tokens": 30, "temperature": 0, "stop": ["return"],
                    "ignore_eos": true}),
            ),
        ];
        for (args, req) in cases {
            let o = run_fixture(model, args);
            let mut body = req.clone();
            body["model"] = "m".into();
            body["prompt"] = PROMPT.into();
            let r = server.post("/v1/completions", &body);
            let text = r["choices"][0]["text"].as_str().expect("text");
            let run_text = o.stdout.strip_suffix('\n').unwrap_or(&o.stdout);
            assert_eq!(run_text, text, "{model} {args:?}: {r}");
            let n = r["usage"]["completion_tokens"].as_u64().unwrap();
            assert!(
                o.stderr.contains(&format!("generation: {n} tokens")),
                "{model} {args:?}: {r} {o:?}"
            );
        }
    }
}

/// The `[N prompt tokens (M reused), ...]` lines of a chat, as (N, M).
fn chat_stats(o: &Out) -> Vec<(usize, usize)> {
    o.stderr
        .lines()
        .filter_map(|l| Some(&l[l.find('[')?..]).filter(|l| l.contains(" reused), ")))
        .map(|l| {
            let n: usize = l[1..].split(' ').next().unwrap().parse().unwrap();
            let m = l.split('(').nth(1).unwrap().split(' ').next().unwrap();
            (n, m.parse().unwrap())
        })
        .collect()
}

/// Turn 2 of a chat resumes from turn 1's tokens (its whole prompt at least), on an
/// attention-only model and on the hybrid ones (whose recurrent state resumes from a
/// checkpoint); after `/reset` the same question is answered from the cache the same way.
#[test]
fn chat_turn_two_reuses_turn_one() {
    for model in ["qwen2-a", "qwen35moe-a", "nemotronh-moe-a"] {
        let dir = fixture(model);
        let o = assert_ok(kapitsa_stdin(
            &["chat", "-m", s(&dir), "-n", "6", "--temp", "0", "-t", "1"],
            Some("hi\nhow are you\n/reset\nhi\n"),
        ));
        let st = chat_stats(&o);
        assert_eq!(st.len(), 3, "{model}: {o:?}");
        assert_eq!(
            st[0].1, 0,
            "{model}: the first turn has nothing to reuse: {o:?}"
        );
        assert!(
            st[1].1 >= st[0].0,
            "{model}: turn 2 reused {} tokens, turn 1's prompt has {}: {o:?}",
            st[1].1,
            st[0].0
        );
        assert!(st[1].1 < st[1].0, "{model}: {o:?}");
        // The same prompt again after /reset: all of it but the last token or so comes from
        // the cache (hybrid models resume at a checkpoint at most a block earlier).
        assert_eq!(st[2].0, st[0].0, "{model}: {o:?}");
        assert!(st[2].1 > 0, "{model}: {o:?}");
        // (Replies of a random model may contain newlines: compare whole outputs.)
        let one = assert_ok(kapitsa_stdin(
            &["chat", "-m", s(&dir), "-n", "6", "--temp", "0", "-t", "1"],
            Some("hi\n"),
        ));
        assert!(
            o.stdout.starts_with(&one.stdout) && o.stdout.ends_with(&one.stdout),
            "{model}: the same question gets the same greedy reply from the cache: {o:?}"
        );
    }
}

/// `--device cuda` (any index) in a build without CUDA: non-zero exit and exactly one stderr
/// line, for every model command; nothing is loaded first.
#[test]
fn device_cuda_without_cuda_is_one_error_line() {
    let dir = fixture("qwen2-a");
    let m = s(&dir);
    let want = "error: this kapitsa was built without CUDA support (cargo feature `cuda`)";
    for dev in ["cuda", "cuda:1", "gpu"] {
        let cmds: Vec<Vec<&str>> = vec![
            vec!["run", "-m", m, "-p", "hi", "--device", dev],
            vec!["chat", "-m", m, "--device", dev],
            vec!["bench", "-m", m, "-p", "4", "-n", "2", "--device", dev],
            vec!["serve", "-m", m, "--port", "0", "--device", dev],
            vec![
                "logits",
                "-m",
                m,
                "-p",
                "hi",
                "--out",
                "/dev/null",
                "--device",
                dev,
            ],
        ];
        for args in cmds {
            let o = kapitsa_stdin(&args, Some("hi\n"));
            assert_error(&o, &["without CUDA support"]);
            assert_eq!(o.stderr.trim_end(), want, "{o:?}");
        }
    }
}

#[test]
fn device_bogus_is_a_clear_error() {
    let dir = fixture("qwen2-a");
    let m = s(&dir);
    for args in [
        vec!["run", "-m", m, "-p", "hi", "--device", "bogus"],
        vec!["chat", "-m", m, "--device", "tpu"],
        vec!["bench", "-m", m, "--device", "cuda:x"],
        vec!["serve", "-m", m, "--device", "cuda:"],
    ] {
        let o = kapitsa(&args);
        let bad = args.last().unwrap();
        assert_error(
            &o,
            &[
                &format!("'{bad}'"),
                "--device",
                "unknown device",
                "use cpu, cuda, cuda:N or auto",
            ],
        );
    }
}

#[test]
fn device_cpu_and_auto_run_on_the_cpu() {
    let auto = run_fixture("qwen2-a", &["-n", "4", "--temp", "0"]);
    assert!(
        auto.stderr
            .contains("device: cpu (no usable GPU: this build has no CUDA support)\n"),
        "{auto:?}"
    );
    let cpu = run_fixture("qwen2-a", &["-n", "4", "--temp", "0", "--device", "cpu"]);
    assert!(cpu.stderr.contains("device: cpu\n"), "{cpu:?}");
    assert_eq!(cpu.stdout, auto.stdout);
    let dir = fixture("qwen2-a");
    let b = assert_ok(kapitsa(&[
        "bench",
        "-m",
        s(&dir),
        "-p",
        "4",
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "1",
        "--device",
        "cpu",
    ]));
    assert!(b.stderr.contains("device: cpu\n"), "{b:?}");
}
