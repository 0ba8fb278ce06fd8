#!/usr/bin/env bash
# scripts/fuzz.sh TARGET SECONDS [libFuzzer options...]
#
# Run one cargo-fuzz target (fuzz/fuzz_targets/TARGET.rs; `scripts/fuzz.sh list` lists them) for
# SECONDS with the stable toolchain (RUSTC_BOOTSTRAP=1 lets it take the -Z flags cargo-fuzz
# needs). Installs cargo-fuzz from crates.io if it is missing. The corpus is fuzz/corpus/TARGET
# (seeded from tests/fixtures by the fuzz-seeds binary when empty); new inputs are added there.
# Crashes, timeouts and out-of-memory inputs land in fuzz/artifacts/TARGET; once fixed, copy a
# reproducer to fuzz/regressions/TARGET/ so that `cargo test -p kapitsa-fuzz-harness` replays
# it. Limits per input: 10 s, 2 GiB RSS, 1 MiB length (FUZZ_MAX_LEN). FUZZ_SANITIZER=address
# turns AddressSanitizer on (default none: the code under test is safe Rust but for the
# kernels, and the box is small). `scripts/fuzz.sh cmin TARGET` minimises the committed corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUSTC_BOOTSTRAP=1
TARGETS="gguf gguf_model hf_dir tokenizer_json chat_template openai_request anthropic_request"
if [ "${1:-}" = list ]; then
    echo "$TARGETS" | tr ' ' '\n'
    exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
SAN="${FUZZ_SANITIZER:-none}"
if [ "${1:-}" = cmin ]; then
    T="$2"
    cargo fuzz cmin --fuzz-dir fuzz -s "$SAN" "$T" "fuzz/corpus/$T" -- -rss_limit_mb=2048 -timeout=10
    exit 0
fi
T="${1:?usage: scripts/fuzz.sh TARGET SECONDS (or list, or cmin TARGET)}"
SECS="${2:?usage: scripts/fuzz.sh TARGET SECONDS}"
shift 2
case " $TARGETS " in *" $T "*) ;; *) echo "unknown target $T (one of: $TARGETS)" >&2; exit 2;; esac
CORPUS="fuzz/corpus/$T"
if [ -z "$(ls -A "$CORPUS" 2>/dev/null)" ]; then
    mkdir -p "$CORPUS"
    cargo run --release -q -p kapitsa-fuzz-harness --bin fuzz-seeds -- fuzz/corpus "$T"
fi
mkdir -p "fuzz/artifacts/$T"
cargo fuzz run --fuzz-dir fuzz -s "$SAN" "$T" "$CORPUS" -- \
    -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -max_len="${FUZZ_MAX_LEN:-1048576}" \
    -print_final_stats=1 "$@"
