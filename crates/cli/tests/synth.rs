//! `kapitsa synth` as a user drives it: a scaled-down file is written (progress on stderr,
//! summary with the type histogram on stdout) and `kapitsa run` generates from it; every error
//! path (unknown preset, bad --layers, bad --quant, missing or bad tokenizer source, unwritable
//! output) exits non-zero with exactly one `error:` line and leaves no output file behind.

use std::path::{Path, PathBuf};
use std::process::Command;

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn kapitsa(args: &[&str]) -> Out {
    let o = Command::new(env!("CARGO_BIN_EXE_kapitsa"))
        .args(args)
        .output()
        .expect("run kapitsa");
    Out {
        ok: o.status.success(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

mod tempfile {
    use std::sync::atomic::{AtomicUsize, Ordering};

    static N: AtomicUsize = AtomicUsize::new(0);

    pub fn tempdir() -> std::io::Result<super::TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!(
            "kapitsa-synth-cli-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p)?;
        Ok(super::TempDir(p))
    }
}

fn tokenizer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3-a/model-f32.gguf")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs `synth` with `args` + `-o DIR/out.gguf`; asserts a one-line error containing `want`
/// and that neither the output nor its `.partial` exists.
fn assert_synth_error(args: &[&str], want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let mut a = vec!["synth"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-o", s(&out)]);
    let o = kapitsa(&a);
    assert!(!o.ok, "expected failure for {args:?}: {}", o.stdout);
    let errors: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.starts_with("error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line for {args:?}: {}", o.stderr);
    assert!(
        errors[0].contains(want),
        "{args:?}: {:?} lacks {want:?}",
        errors[0]
    );
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    assert!(!out.exists());
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "nothing written"
    );
}

#[test]
fn unknown_preset() {
    let t = tokenizer();
    assert_synth_error(
        &["--preset", "llama-70b", "--tokenizer-from", s(&t)],
        "unknown preset 'llama-70b'",
    );
}

#[test]
fn bad_layer_counts() {
    let t = tokenizer();
    for (preset, layers, want) in [
        ("qwen3.6-35b-a3b", "6", "multiple of 4"),
        ("qwen3.6-35b-a3b", "44", "4..=40"),
        ("qwen3-30b-a3b", "0", "1..=48"),
        ("nemotron-3-nano-30b-a3b", "5", "6..=52"),
    ] {
        assert_synth_error(
            &[
                "--preset",
                preset,
                "--layers",
                layers,
                "--tokenizer-from",
                s(&t),
            ],
            want,
        );
    }
}

#[test]
fn bad_quant() {
    let t = tokenizer();
    assert_synth_error(
        &[
            "--preset",
            "qwen3-30b-a3b",
            "--quant",
            "q2_k",
            "--tokenizer-from",
            s(&t),
        ],
        "unknown --quant 'q2_k'",
    );
}

#[test]
fn missing_tokenizer_source() {
    assert_synth_error(&["--preset", "qwen3-30b-a3b"], "--tokenizer-from");
}

#[test]
fn bad_tokenizer_sources() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all").unwrap();
    assert_synth_error(
        &["--preset", "qwen3-30b-a3b", "--tokenizer-from", s(&junk)],
        "bad tokenizer source",
    );
    assert_synth_error(
        &[
            "--preset",
            "qwen3-30b-a3b",
            "--tokenizer-from",
            "/nonexistent/t.gguf",
        ],
        "bad tokenizer source",
    );
}

#[test]
fn tokenizer_larger_than_vocabulary_is_refused() {
    let t = tokenizer();
    assert_synth_error(
        &[
            "--preset",
            "qwen3-30b-a3b",
            "--layers",
            "1",
            "--width-divisor",
            "1024",
            "--tokenizer-from",
            s(&t),
        ],
        "--vocab-from-tokenizer",
    );
}

#[test]
fn unwritable_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("no-such-dir").join("m.gguf");
    let t = tokenizer();
    let o = kapitsa(&[
        "synth",
        "--preset",
        "qwen3-30b-a3b",
        "--layers",
        "1",
        "--width-divisor",
        "16",
        "--tokenizer-from",
        s(&t),
        "-o",
        s(&out),
    ]);
    assert!(!o.ok);
    let errors: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.starts_with("error:"))
        .collect();
    assert_eq!(errors.len(), 1, "{}", o.stderr);
    assert!(errors[0].contains("cannot create"), "{}", errors[0]);
    assert!(!out.exists());
}

#[test]
fn writes_a_file_that_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nano.gguf");
    let t = tokenizer();
    let o = kapitsa(&[
        "synth",
        "--preset",
        "nemotron-3-nano-30b-a3b",
        "--layers",
        "8",
        "--width-divisor",
        "16",
        "--tokenizer-from",
        s(&t),
        "--seed",
        "3",
        "-o",
        s(&out),
    ]);
    assert!(o.ok, "{}", o.stderr);
    assert!(out.exists() && !dir.path().join("nano.gguf.partial").exists());
    assert!(o.stderr.contains("MEMEM*EM"), "{}", o.stderr);
    assert!(
        o.stderr.contains("(100%)"),
        "progress on stderr: {}",
        o.stderr
    );
    assert!(o.stdout.contains("tensor types:"), "{}", o.stdout);
    assert!(o.stdout.contains("q5_0"), "{}", o.stdout);
    let r = kapitsa(&[
        "run",
        "-m",
        s(&out),
        "-p",
        "hello",
        "-n",
        "8",
        "--temp",
        "0",
    ]);
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stderr.contains("generation: 8 tokens"), "{}", r.stderr);
}
