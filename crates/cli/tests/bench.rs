//! `kapitsa bench` as a user drives it: bad arguments fail before the model loads with exactly
//! one `error:` line; a tiny run on the f32 Qwen2 fixture prints a llama-bench style markdown
//! table (weights memory-mapped) or a JSON array with one entry per test (weights copied into
//! memory); `--membw` reports two bandwidths. No timing is asserted beyond "positive and
//! finite".

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

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen2-a/model-f32.gguf")
}

fn tiny_str() -> String {
    tiny().to_str().expect("utf-8 path").to_string()
}

/// `bench` with `args` fails with one `error:` line and `want` in its message (clap puts the
/// details of a usage error on the following lines), nothing on stdout.
fn assert_error(args: &[&str], want: &str) {
    let mut a = vec!["bench"];
    a.extend_from_slice(args);
    let o = kapitsa(&a);
    assert!(!o.ok, "expected failure for {args:?}: {}", o.stdout);
    assert!(o.stdout.is_empty(), "stdout for {args:?}: {}", o.stdout);
    let errors: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.starts_with("error:"))
        .collect();
    assert_eq!(errors.len(), 1, "{args:?}: {}", o.stderr);
    assert!(
        o.stderr.contains(want),
        "{args:?}: wanted {want:?} in {}",
        o.stderr
    );
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
}

#[test]
fn bad_arguments_fail_cleanly() {
    let m = tiny_str();
    assert_error(&[], "--model");
    assert_error(&["-m", "/nonexistent/model.gguf"], "does not exist");
    assert_error(&["-m", &m, "-r", "0"], "repetitions must be >= 1");
    assert_error(&["-m", &m, "-p", "0", "-n", "0"], "nothing to measure");
    assert_error(&["-m", &m, "-p", "12,x"], "invalid value 'x'");
    assert_error(&["-m", &m, "-o", "xml"], "invalid value 'xml'");
    assert_error(&["-m", &m, "--kv-type", "q8"], "unknown --kv-type");
    assert_error(&["-m", &m, "--load-mode", "ram"], "invalid value 'ram'");
    // More positions than the fixture's training context (512).
    assert_error(&["-m", &m, "-p", "400", "-d", "400"], "cache positions");
    assert_error(&["--membw", "-m", &m], "cannot be used with");
    // Not a GGUF file.
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    assert_error(&["-m", readme.to_str().unwrap()], "not a GGUF file");
}

#[test]
fn markdown_table_shape() {
    let m = tiny_str();
    let o = kapitsa(&[
        "bench",
        "-m",
        &m,
        "-p",
        "16",
        "-n",
        "4",
        "-d",
        "0,8",
        "-r",
        "2",
        "-t",
        "1",
        "--load-mode",
        "mmap",
    ]);
    assert!(o.ok, "{}", o.stderr);
    // Progress went to stderr.
    assert!(o.stderr.contains("pp16: warm-up"), "{}", o.stderr);
    assert!(o.stderr.contains("tg4 @ d8: run 2/2"), "{}", o.stderr);
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert_eq!(lines.len(), 2 + 4, "{}", o.stdout);
    let cells = |l: &str| -> Vec<String> {
        assert!(l.starts_with('|') && l.ends_with('|'), "{l}");
        l.trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    assert_eq!(
        cells(lines[0]),
        ["model", "size", "params", "backend", "threads", "test", "t/s"]
    );
    assert!(cells(lines[1])
        .iter()
        .all(|c| c.chars().all(|ch| ch == '-' || ch == ':')));
    let tests: Vec<String> = lines[2..].iter().map(|l| cells(l)[5].clone()).collect();
    assert_eq!(tests, ["pp16", "tg4", "pp16 @ d8", "tg4 @ d8"]);
    for l in &lines[2..] {
        let c = cells(l);
        assert!(c[0].starts_with("qwen2 "), "{l}");
        assert!(c[1].ends_with("MiB"), "{l}");
        assert_eq!(c[4], "1");
        let (mean, sd) = c[6].split_once(" ± ").expect("mean ± sd");
        let mean: f64 = mean.parse().expect("mean");
        let sd: f64 = sd.parse().expect("sd");
        assert!(mean > 0.0 && mean.is_finite() && sd >= 0.0, "{l}");
    }
}

#[test]
fn json_shape() {
    let m = tiny_str();
    let o = kapitsa(&[
        "bench",
        "-m",
        &m,
        "-p",
        "8,16",
        "-n",
        "3",
        "-r",
        "3",
        "-t",
        "2",
        "-o",
        "json",
        "--load-mode",
        "memory",
    ]);
    assert!(o.ok, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).expect("JSON on stdout");
    let arr = v.as_array().expect("an array");
    assert_eq!(arr.len(), 3);
    let want = [(8, 0, "pp8"), (16, 0, "pp16"), (0, 3, "tg3")];
    for (e, (p, n, name)) in arr.iter().zip(want) {
        assert_eq!(e["n_prompt"], p);
        assert_eq!(e["n_gen"], n);
        assert_eq!(e["n_depth"], 0);
        assert_eq!(e["test"], name);
        assert_eq!(e["n_threads"], 2);
        assert_eq!(e["model_filename"], "model-f32.gguf");
        let size = e["model_size"].as_u64().expect("model_size");
        assert!(size > 0 && size <= std::fs::metadata(tiny()).unwrap().len());
        assert!(e["model_n_params"].as_u64().unwrap() > 0);
        let ts = e["samples_ts"].as_array().expect("samples_ts");
        let ns = e["samples_ns"].as_array().expect("samples_ns");
        assert_eq!(ts.len(), 3);
        assert_eq!(ns.len(), 3);
        let tokens = (p + n) as f64;
        for (t, n) in ts.iter().zip(ns) {
            let (t, n) = (t.as_f64().unwrap(), n.as_f64().unwrap());
            assert!(t > 0.0 && t.is_finite());
            assert!(
                (t - tokens * 1e9 / n).abs() <= 1e-6 * t,
                "t/s = tokens / time"
            );
        }
        let mean: f64 = ts.iter().map(|t| t.as_f64().unwrap()).sum::<f64>() / 3.0;
        assert!((e["avg_ts"].as_f64().unwrap() - mean).abs() <= 1e-9 * mean);
        assert!(e["stddev_ts"].as_f64().unwrap() >= 0.0);
        let bytes = e["decode_weight_bytes_per_token"].as_u64().expect("bytes");
        assert!(bytes > 0 && bytes <= size, "{bytes} vs {size}");
        assert_eq!(e["recurrent_state_bytes"], 0);
    }
}

#[test]
fn membw_reports_bandwidths() {
    let o = kapitsa(&[
        "bench",
        "--membw",
        "--membw-mib",
        "8",
        "-t",
        "2",
        "-r",
        "2",
        "-o",
        "json",
    ]);
    assert!(o.ok, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).expect("JSON on stdout");
    assert_eq!(v["n_threads"], 2);
    assert_eq!(v["buffer_bytes"], 8 << 20);
    for k in ["read_bytes_per_sec", "copy_bytes_per_sec"] {
        let x = v[k].as_f64().expect(k);
        assert!(x > 0.0 && x.is_finite(), "{k} = {x}");
    }
    let o = kapitsa(&["bench", "--membw", "--membw-mib", "8", "-r", "1"]);
    assert!(o.ok, "{}", o.stderr);
    assert!(
        o.stdout.contains("| read |") && o.stdout.contains("| copy |"),
        "{}",
        o.stdout
    );
}
