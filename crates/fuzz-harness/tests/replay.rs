//! Regression replay of the fuzzers (CI, stable toolchain): every target's seeds, its committed
//! corpus (`fuzz/corpus/<target>/`) and every crash reproducer (`fuzz/artifacts/<target>/`,
//! `fuzz/regressions/<target>/`) run through the same bodies the fuzzers use. Any panic fails.

use std::path::Path;
use std::time::Instant;

fn files_in(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.is_file());
    v.sort();
    v
}

#[test]
fn replay_seeds_corpora_and_reproducers() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for (name, body) in kapitsa_fuzz_harness::TARGETS {
        let start = Instant::now();
        let seeds = kapitsa_fuzz_harness::seeds(name);
        assert!(!seeds.is_empty(), "{name}: no seeds (fixtures missing?)");
        // The seeds are valid inputs: each must go all the way through, or the target tests
        // nothing past its first error.
        for (i, seed) in seeds.iter().enumerate() {
            assert!(body(seed), "{name}: seed {i} did not go through");
        }
        let mut n = seeds.len();
        for sub in ["corpus", "artifacts", "regressions"] {
            for file in files_in(&fuzz.join(sub).join(name)) {
                let data = std::fs::read(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
                eprintln!("{name}: {}", file.display());
                body(&data);
                n += 1;
            }
        }
        eprintln!("{name}: {n} inputs in {:?}", start.elapsed());
    }
}
