//! `fuzz-seeds DIR [TARGET]`: write the seed inputs of every fuzz target (or of TARGET) into
//! `DIR/<target>/seed-N`, for `scripts/fuzz.sh` to start a corpus from.

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: fuzz-seeds DIR [TARGET]");
        std::process::exit(2);
    };
    let only = args.next();
    for (name, _) in kapitsa_fuzz_harness::TARGETS {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let out = std::path::Path::new(&dir).join(name);
        std::fs::create_dir_all(&out)?;
        for (i, seed) in kapitsa_fuzz_harness::seeds(name).iter().enumerate() {
            std::fs::write(out.join(format!("seed-{i}")), seed)?;
        }
    }
    Ok(())
}
