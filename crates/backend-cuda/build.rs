//! Build script: with the `cuda` feature, compile every `kernels/*.cu` to an sm_90a cubin
//! with nvcc and embed them through `$OUT_DIR/kernels.rs`, a table
//! `KERNELS: &[(&str, &[u8])]` of (file stem, cubin bytes). Without the feature the table is
//! empty and nothing else happens (no CUDA, no nvcc).
//!
//! nvcc is `$NVCC`, else `nvcc` on `PATH`, else
//! `${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/nvcc/bin/nvcc` (what `scripts/install-nvcc.sh`
//! makes). With no nvcc the build fails, unless `KAPITSA_SKIP_KERNELS=1`, which embeds empty
//! blobs (the backend then answers `Unavailable` at run time). `KAPITSA_PTXAS_VERBOSE=1` prints
//! ptxas' register and spill report as build warnings.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=KAPITSA_SKIP_KERNELS");
    println!("cargo:rerun-if-env-changed=KAPITSA_CACHE");
    println!("cargo:rerun-if-env-changed=KAPITSA_PTXAS_VERBOSE");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let table = out_dir.join("kernels.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        write(
            &table,
            "pub(crate) static KERNELS: &[(&str, &[u8])] = &[];\n",
        );
        return;
    }

    let kdir = Path::new("kernels");
    println!("cargo:rerun-if-changed=kernels");
    let mut sources = Vec::new();
    for entry in fs::read_dir(kdir).expect("crates/backend-cuda/kernels is readable") {
        let path = entry.expect("directory entry").path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => {
                println!("cargo:rerun-if-changed={}", path.display());
                sources.push(path);
            }
            Some("cuh") => println!("cargo:rerun-if-changed={}", path.display()),
            _ => {}
        }
    }
    sources.sort();
    let stems: Vec<String> = sources
        .iter()
        .map(|p| {
            p.file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("")
                .to_string()
        })
        .collect();

    let Some(nvcc) = find_nvcc() else {
        if env::var("KAPITSA_SKIP_KERNELS").as_deref() == Ok("1") {
            println!(
                "cargo:warning=kapitsa-backend-cuda: no nvcc found, KAPITSA_SKIP_KERNELS=1: \
                 building without CUDA kernels (the backend will report itself unavailable)"
            );
            let mut s = String::from("pub(crate) static KERNELS: &[(&str, &[u8])] = &[\n");
            for stem in &stems {
                let _ = writeln!(s, "    ({stem:?}, &[]),");
            }
            s.push_str("];\n");
            write(&table, &s);
            return;
        }
        fail(
            "kapitsa-backend-cuda: the `cuda` feature needs nvcc to compile kernels/*.cu, and none \
             was found (looked at $NVCC, `nvcc` on PATH and \
             ${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/nvcc/bin/nvcc).\n\
             Install it without a CUDA toolkit or GPU with `scripts/install-nvcc.sh` (pip wheels, \
             ~270 MB), or set NVCC=/path/to/nvcc, or set KAPITSA_SKIP_KERNELS=1 to build a binary \
             without kernels."
                .to_string(),
        );
    };

    let verbose = env::var("KAPITSA_PTXAS_VERBOSE").as_deref() == Ok("1");
    // Start every compile, then wait for all (nvcc is single-threaded per file).
    let mut jobs = Vec::new();
    for (src, stem) in sources.iter().zip(&stems) {
        let cubin = out_dir.join(format!("{stem}.cubin"));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("-cubin")
            .arg("-gencode=arch=compute_90a,code=sm_90a")
            .args(["-O3", "-std=c++17", "-lineinfo"])
            .arg("-I")
            .arg(kdir)
            .arg("-o")
            .arg(&cubin)
            .arg(src);
        if verbose {
            cmd.args(["-Xptxas", "-v"]);
        }
        let child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("kapitsa-backend-cuda: cannot run {}: {e}", nvcc.display()));
        jobs.push((src.clone(), cubin, child));
    }
    let mut s = String::from("pub(crate) static KERNELS: &[(&str, &[u8])] = &[\n");
    for ((src, cubin, child), stem) in jobs.into_iter().zip(&stems) {
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("kapitsa-backend-cuda: nvcc on {}: {e}", src.display()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            fail(format!(
                "kapitsa-backend-cuda: nvcc failed on {} ({}):\n{}{}",
                src.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                stderr
            ));
        }
        if verbose {
            for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
                println!("cargo:warning={stem}: {line}");
            }
        }
        let _ = writeln!(
            s,
            "    ({stem:?}, include_bytes!({:?})),",
            cubin.display().to_string()
        );
    }
    s.push_str("];\n");
    write(&table, &s);
}

/// `$NVCC`, else `nvcc` on `PATH`, else the install script's location.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(paths) = env::var_os("PATH") {
        for dir in env::split_paths(&paths) {
            let cand = dir.join("nvcc");
            if cand.is_file() {
                return Some(cand);
            }
        }
    }
    let cache = env::var_os("KAPITSA_CACHE")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kapitsa")))?;
    let cand = cache.join("nvcc").join("bin").join("nvcc");
    cand.is_file().then_some(cand)
}

/// Stop the build with `msg` (no backtrace: this is a setup problem, not a bug).
fn fail(msg: String) -> ! {
    eprintln!("{msg}");
    std::process::exit(1);
}

fn write(path: &Path, contents: &str) {
    // Only rewrite when changed, so the crate is not recompiled needlessly.
    if fs::read_to_string(path).ok().as_deref() != Some(contents) {
        fs::write(path, contents)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }
}
