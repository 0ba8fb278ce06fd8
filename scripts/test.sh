#!/usr/bin/env bash
# The project's test command: fetch the real test weights (cached), then build and run every
# test of the workspace in release mode (the real-model tests need optimised code), then the
# Python SDK tests against the server (a virtualenv with openai/anthropic/pytest is made once).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-weights.sh all >/dev/null
export KAPITSA_MODELS="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/models"
export PROPTEST_CASES="${PROPTEST_CASES:-256}"
cargo test --release --workspace "$@"
# The OpenAI / Anthropic Python SDKs against `kapitsa serve` on the real 0.5B model.
scripts/sdk-tests.sh "$KAPITSA_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
