//! The committed tiny hybrid and MoE fixtures (tests/fixtures/tiny) through the `kapitsa` CLI.

use std::path::Path;

mod common;
use common::*;

fn generated(o: &Out) -> String {
    o.stdout.strip_suffix('\n').unwrap_or(&o.stdout).to_string()
}

fn run_greedy(model: &Path, prompt: &str, n: usize) -> Out {
    let n = n.to_string();
    kapitsa(&[
        "run",
        "--model",
        s(model),
        "-p",
        prompt,
        "-n",
        &n,
        "--temp",
        "0",
    ])
}

/// The committed tiny hybrid / MoE fixtures (tests/fixtures/tiny) through the CLI: the HF
/// directory and llama.cpp's GGUF conversion of it generate the same greedy text, and a
/// two-turn chat works on a model whose recurrent state cannot be rewound.
#[test]
fn hybrid_fixtures_run_and_chat() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    for (name, kinds) in [
        ("qwen35moe-a", "1 attention, 3 recurrent"),
        ("qwen35moe-b", "+1 MTP kept"),
        ("qwen3moe-a", "3 attention"),
        ("nemotronh-moe-a", "1 attention, 3 recurrent"),
    ] {
        let dir = root.join(name);
        let a = assert_ok(run_greedy(&dir, "def add(a, b):", 12));
        let b = assert_ok(run_greedy(
            &dir.join("model-f32.gguf"),
            "def add(a, b):",
            12,
        ));
        assert!(a.stderr.contains(kinds), "{name}: {a:?}");
        assert_eq!(generated(&a), generated(&b), "{name}: HF and GGUF differ");
        // (Replies of a random model may contain newlines: compare whole outputs.)
        let chat = |input: &str| {
            assert_ok(kapitsa_stdin(
                &["chat", "--model", s(&dir), "-n", "5", "--temp", "0"],
                Some(input),
            ))
        };
        let one = chat("hi\n");
        let three = chat("hi\nhow are you\n/reset\nhi\n");
        assert!(!one.stdout.is_empty(), "{name}: {one:?}");
        assert!(
            three.stdout.starts_with(&one.stdout) && three.stdout.ends_with(&one.stdout),
            "{name}: same question after /reset must get the same reply: {three:?}"
        );
        assert!(
            three.stdout.len() > 2 * one.stdout.len(),
            "{name}: {three:?}"
        );
    }
}
