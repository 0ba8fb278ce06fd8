#!/usr/bin/env bash
# The main job: fetch Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, cached), build kapitsa and ask
# it for a function, streaming the answer. Extra arguments go to `kapitsa run`.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-weights.sh 0.5b)
cargo build --release -q -p kapitsa-cli
if [ "$#" -eq 0 ]; then
  set -- --chat "Write a Python function that checks whether a number is prime." -n 200 --temp 0
fi
exec target/release/kapitsa run --model "$model" "$@"
