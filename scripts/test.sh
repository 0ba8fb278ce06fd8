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
# The CUDA backend must build (no GPU here): the pinned pip nvcc compiles every kernel to an
# sm_90a cubin, then the crate's tests check the one-line "no GPU" error. The GPU checks
# themselves run on a GPU machine with scripts/test-gpu.sh.
NVCC="$(scripts/install-nvcc.sh)" cargo test --release -p kapitsa-backend-cuda --features cuda "$@"
# The OpenAI / Anthropic Python SDKs against `kapitsa serve` on the real 0.5B model.
scripts/sdk-tests.sh "$KAPITSA_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
