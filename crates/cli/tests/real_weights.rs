//! CLI checks on the real Qwen2.5-Coder-0.5B file (optional: skipped unless `KAPITSA_MODELS`
//! is set; required when `CI` is set): a truncated copy fails cleanly, `inspect` lists the
//! real tensors, and `KAPITSA_NUMERICS=llama.cpp` reproduces llama.cpp's logits.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const REAL_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn real_model() -> Option<PathBuf> {
    let ci = std::env::var_os("CI").is_some();
    let Some(dir) = std::env::var_os("KAPITSA_MODELS") else {
        assert!(
            !ci,
            "CI is set but KAPITSA_MODELS is not (needs {REAL_FILE})"
        );
        println!("note: KAPITSA_MODELS not set; skipping the real-weight CLI checks");
        return None;
    };
    let p = PathBuf::from(dir).join(REAL_FILE);
    if !p.is_file() {
        assert!(!ci, "CI is set but {} is missing", p.display());
        println!(
            "note: {} missing; skipping the real-weight CLI checks",
            p.display()
        );
        return None;
    }
    Some(p)
}

/// `KAPITSA_NUMERICS=llama.cpp` gives llama.cpp's logits bit for bit on the real 0.5B (the
/// last prompt row of a fixture prompt, `tests/fixtures/real`), and a value we do not know is
/// one clear error.
#[test]
fn numerics_llama_cpp_reproduces_llama_cpp_logits() {
    let d = TempDir::new("numerics");
    let m = d.write("tiny.gguf", &model_bytes(&ModelOpts::default()));
    let out = d.path().join("x.f32");
    let o = kapitsa_env(
        &[
            "logits",
            "--model",
            s(&m),
            "--tokens",
            "1,2",
            "--out",
            s(&out),
        ],
        None,
        &[("KAPITSA_NUMERICS", "fast")],
    );
    assert_error(&o, &["KAPITSA_NUMERICS", "'fast'"]);

    let Some(real) = real_model() else { return };
    if !std::arch::is_x86_feature_detected!("avx512f") {
        println!("note: no AVX-512; llama.cpp-compatible numerics need it");
        return;
    }
    let fx_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/real");
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fx_dir.join("qwen2.5-coder-0.5b.json")).unwrap(),
    )
    .unwrap();
    let p = &fx["prompts"][0];
    let ids: Vec<String> = p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let want = f32s(&std::fs::read(fx_dir.join(p["last_logits"].as_str().unwrap())).unwrap());
    let args = [
        "logits",
        "--model",
        s(&real),
        "--tokens",
        &ids.join(","),
        "--kv-type",
        "f32",
        "--out",
        s(&out),
    ];
    for (numerics, exact) in [("llama.cpp", true), ("default", false)] {
        assert_ok(kapitsa_env(&args, None, &[("KAPITSA_NUMERICS", numerics)]));
        let got = f32s(&std::fs::read(&out).unwrap());
        let last = &got[got.len() - want.len()..];
        let n_diff = last
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        println!(
            "KAPITSA_NUMERICS={numerics}: {n_diff} of {} logits differ",
            want.len()
        );
        // The default kernels sum in other (equally exact) orders, so some logits differ.
        assert_eq!(n_diff == 0, exact, "KAPITSA_NUMERICS={numerics}");
    }
}

#[test]
fn real_weights_truncated_copy_and_inspect() {
    let Some(real) = real_model() else { return };
    let o = assert_ok(kapitsa(&["inspect", s(&real)]));
    assert!(
        o.stdout.contains("general.architecture = \"qwen2\""),
        "{}",
        &o.stdout[..o.stdout.len().min(2000)]
    );
    assert!(
        o.stdout.contains("291 tensors"),
        "{}",
        &o.stdout[..o.stdout.len().min(2000)]
    );
    for name in [
        "token_embd.weight",
        "output.weight",
        "blk.23.ffn_down.weight",
    ] {
        assert!(o.stdout.contains(name), "{name} not listed");
    }

    use std::io::Read;
    let mut head = vec![0u8; 64 << 20];
    std::fs::File::open(&real)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    let d = TempDir::new("real");
    let p = d.write("truncated-0.5b.gguf", &head);
    drop(head);
    let o = kapitsa(&["run", "--model", s(&p), "-p", "hi", "-n", "1"]);
    let line = assert_error(&o, &["truncated-0.5b.gguf", "out of bounds"]);
    println!("truncated real file: {line}");
    assert_error(
        &kapitsa(&["inspect", s(&p)]),
        &["out of bounds", "truncated-0.5b.gguf"],
    );
}
