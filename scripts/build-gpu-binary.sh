#!/usr/bin/env bash
# Build the kapitsa binary with the CUDA backend here (no GPU needed: the pinned pip nvcc
# compiles the kernels to sm_90a cubins embedded in the binary), strip and compress it into
# bench/.cache/kapitsa.xz (ignored by git), the form that travels to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="$(scripts/install-nvcc.sh)"
export NVCC
cargo build --release -p kapitsa-cli --features cuda
mkdir -p bench/.cache
strip -o bench/.cache/kapitsa "${CARGO_TARGET_DIR:-target}/release/kapitsa"
xz -9e -T2 -f bench/.cache/kapitsa
ls -l bench/.cache/kapitsa.xz
