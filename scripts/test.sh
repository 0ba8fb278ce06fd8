#!/usr/bin/env bash
# The project's test command: fetch the real test weights (cached), then build and run every
# test of the workspace in release mode (the real-model tests need optimised code).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-weights.sh all >/dev/null
export KAPITSA_MODELS="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/models"
export PROPTEST_CASES="${PROPTEST_CASES:-256}"
cargo test --release --workspace "$@"
