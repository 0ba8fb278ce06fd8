//! The dependency rules of the backend seam (DESIGN.md §3, issue "a device-neutral core"):
//! models, the cache, the engine and the server reach the CPU kernels only through the
//! `Backend` trait, so no file of theirs (sources, tests, examples, manifests) names
//! kernels-cpu; and the cache does not depend on models.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "toml") {
            out.push(p);
        }
    }
}

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Files of `krate` that contain any of `needles`.
fn offenders(krate: &str, needles: &[&str]) -> Vec<String> {
    let mut fs = Vec::new();
    files(&crates_dir().join(krate), &mut fs);
    assert!(!fs.is_empty(), "crate {krate} has no files");
    fs.iter()
        .filter(|p| {
            let s = std::fs::read_to_string(p).unwrap_or_default();
            needles.iter().any(|n| s.contains(n))
        })
        .map(|p| p.display().to_string())
        .collect()
}

#[test]
fn only_backends_use_the_cpu_kernels() {
    for krate in ["models", "cache", "engine", "server", "backend"] {
        let bad = offenders(krate, &["kapitsa_kernels_cpu", "kapitsa-kernels-cpu"]);
        assert!(bad.is_empty(), "{krate} names kernels-cpu in {bad:?}");
    }
}

#[test]
fn cache_does_not_depend_on_models() {
    let bad = offenders("cache", &["kapitsa_models", "kapitsa-models"]);
    assert!(bad.is_empty(), "cache names models in {bad:?}");
}

#[test]
fn the_check_can_fail() {
    // The scan finds the kernels where they are used, so an empty result above means
    // something.
    assert!(!offenders("backend-cpu", &["kapitsa_kernels_cpu"]).is_empty());
}

/// `kapitsa selftest --device cpu` (what scripts/test-gpu.sh runs with `--device cuda`)
/// passes on the CPU: the op suite (fast kernels against the scalar reference) and the tiny
/// qwen2/qwen3 checkpoints.
#[test]
fn selftest_passes_on_the_cpu() {
    let root = crates_dir().join("..");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kapitsa"))
        .args(["selftest", "--device", "cpu", "--cases", "2", "--fixtures"])
        .arg(root.join("tests/fixtures/tiny"))
        .output()
        .expect("run kapitsa");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "selftest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("op matmul q4_K vs exact"), "{stdout}");
    assert!(
        stdout.contains("qwen3-a p0 logits vs transformers"),
        "{stdout}"
    );
    assert!(stdout.contains(" 0 failed"), "{stdout}");
}
