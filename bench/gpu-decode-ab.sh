#!/usr/bin/env bash
# Decode with and without recorded steps (CUDA graphs + programmatic dependent launch), run ON
# the GPU machine: `kapitsa bench --device cuda` on synthetic dense files, once with the
# defaults, once with KAPITSA_CUDA_GRAPHS=0 (op by op) and once with KAPITSA_CUDA_PDL=0
# (graphs without PDL), so the table shows what each step is worth. It only measures:
# correctness (recorded == op by op) is scripts/test-gpu.sh's job.
#
# usage: bench/gpu-decode-ab.sh [PRESET...]   (default: qwen2.5-coder-1.5b qwen3-8b)
# env:   OUT (logs) [/tmp/kapitsa-ab], SYNTH_DIR [/tmp/kapitsa-synth], KAPITSA_BIN,
#        AB_ARGS extra bench arguments [-p 0 -n 128 -r 3], AB_MODES [graphs no-pdl op-by-op]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kapitsa-ab}"
SYNTH_DIR="${SYNTH_DIR:-/tmp/kapitsa-synth}"
mkdir -p "$OUT" "$SYNTH_DIR"
BIN="${KAPITSA_BIN:-}"
if [[ -z "$BIN" ]]; then
  BIN=/tmp/kapitsa
  [[ -x "$BIN" ]] || { xz -dc bench/.cache/kapitsa.xz > "$BIN"; chmod +x "$BIN"; }
fi
for d in /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# the tokenizer only matters for text; bench feeds token ids
TOK="${TOK:-tests/fixtures/tiny/qwen2-a/model-f32.gguf}"
presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(qwen2.5-coder-1.5b qwen3-8b)
read -r -a args <<< "${AB_ARGS:--p 0 -n 128 -r 3}"
for p in "${presets[@]}"; do
  f="$SYNTH_DIR/$p.gguf"
  [[ -f "$f" ]] || "$BIN" synth --preset "$p" --tokenizer-from "$TOK" -o "$f" >"$OUT/synth-$p.log" 2>&1
  for mode in ${AB_MODES:-graphs no-pdl op-by-op}; do
    case $mode in
      graphs) env=() ;;
      no-pdl) env=(KAPITSA_CUDA_PDL=0) ;;
      op-by-op) env=(KAPITSA_CUDA_GRAPHS=0) ;;
    esac
    echo "== $p $mode"
    env "${env[@]}" "$BIN" bench -m "$f" --device cuda "${args[@]}" 2>"$OUT/bench-$p-$mode.log" \
      | tee "$OUT/bench-$p-$mode.txt"
  done
done
