#!/usr/bin/env bash
# The CUDA correctness checks, run ON the GPU machine (it has no Rust toolchain: the kapitsa
# binary is built here with `--features cuda`, stripped, xz-compressed and carried as
# bench/.cache/kapitsa.xz; see scripts/build-gpu-binary.sh). Logs go to $OUT (or /tmp).
#
#   1. `kapitsa selftest --device cuda`: every backend op against the CPU scalar reference on
#      random shapes (odd sizes and tails), every tiny fixture (dense, MoE, Gated DeltaNet and
#      Mamba2 hybrids; `TEST_GPU_ARCHS` narrows it, e.g. qwen2,qwen3) within 1e-4 of
#      transformers with 32 equal greedy tokens (decode steps recorded as CUDA graphs), one
#      chunk == pieces == token by token, a batch of 3 == each alone, speculative == plain,
#      the vision-language fixtures (`reference_vl.json`: the vision tower's rows and the
#      logits with images within 1e-4 of transformers, 32 greedy tokens with images through
#      the engine), and synthetic files' logits against the CPU engine's: dense Qwen2.5-Coder-1.5B, and the
#      Qwen3.6-35B-A3B, Qwen3-30B-A3B and Nemotron 3 Nano shapes with a few layers
#      (`TEST_GPU_SYNTH` lists `preset:layers`); then the hybrid and MoE fixtures again with
#      their decode steps run op by op instead of recorded as graphs (`KAPITSA_RECORD_HYBRID=0`);
#      then the ops, the Gated DeltaNet and Mamba2 fixtures and the synthetic Qwen3.6 and
#      Nemotron with the chunked scans for every sequence, decode steps too
#      (`KAPITSA_GDN_CHUNK_MIN=1 KAPITSA_MAMBA2_CHUNK_MIN=1`; by default only sequences of 64
#      tokens or more take them); then the
#      ops, one fixture and the synthetic files with the int8-activation GEMVs on every
#      one-token launch (`KAPITSA_GEMV_X8=1`; by default only on rows a pre-norm wrote) and
#      the MoE's pre-norm inside its router (`KAPITSA_MOE_PRENORM=1`, off by default).
#   2. `--gpu-memory`: a budget below the synthetic Qwen3.6 file fails before loading with a
#      clear error; one that fits runs it with the reported peak within the budget.
#   3. `kapitsa serve --device cuda --gpu-memory 4GiB` answering the same HTTP checks as on
#      the CPU (streaming, concurrency) on the tiny qwen2 fixture, its KV cache sized from
#      the budget.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kapitsa-gpu}"
mkdir -p "$OUT"
BIN="${KAPITSA_BIN:-}"
if [[ -z "$BIN" ]]; then
  if [[ -f bench/.cache/kapitsa.xz ]]; then
    BIN=/tmp/kapitsa
    xz -dc bench/.cache/kapitsa.xz > "$BIN"
    chmod +x "$BIN"
  else
    BIN=target/release/kapitsa
  fi
fi
# cudarc loads libcuda (driver) and cuBLAS dynamically; cuBLAS sits in the toolkit's lib dir.
# (Never add .../compat: it holds an older libcuda than the running driver.)
for d in /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

status=0
echo "== selftest (ops, tiny fixtures, synthetic file) =="
SYNTH="${TEST_GPU_SYNTH:-qwen2.5-coder-1.5b:4 qwen3.6-35b-a3b:4 qwen3-30b-a3b:4 nemotron-3-nano-30b-a3b:8}"
models=()
for pl in $SYNTH; do
  preset="${pl%%:*}" layers="${pl##*:}"
  f="/tmp/kapitsa-syn-$preset-L$layers.gguf"
  if [[ -f "$f" ]] || "$BIN" synth --preset "$preset" --layers "$layers" \
      --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o "$f" >>"$OUT/synth.log" 2>&1; then
    models+=(--model "$f")
  else
    echo "FAIL synth of $preset ($layers layers) failed (see synth.log)"
    status=1
  fi
done
"$BIN" selftest --device cuda --fixtures tests/fixtures/tiny \
  --archs "${TEST_GPU_ARCHS:-}" "${models[@]}" 2>&1 | tee "$OUT/selftest.log" || status=1

echo "== selftest, hybrid and MoE decode steps op by op (KAPITSA_RECORD_HYBRID=0) =="
KAPITSA_RECORD_HYBRID=0 "$BIN" selftest --device cuda --fixtures tests/fixtures/tiny --no-ops \
  --archs "${TEST_GPU_HYBRID_ARCHS:-qwen3_5,qwen3_5_moe,qwen3_moe,nemotron_h,nemotron_h_moe}" \
  2>&1 | tee "$OUT/selftest-op-by-op.log" || status=1

echo "== selftest, the chunked scans for every sequence (KAPITSA_GDN_CHUNK_MIN=1 KAPITSA_MAMBA2_CHUNK_MIN=1) =="
scan_models=()
for m in "${models[@]}"; do [[ "$m" == *qwen3.6* || "$m" == *nemotron* ]] && scan_models+=(--model "$m"); done
KAPITSA_GDN_CHUNK_MIN=1 KAPITSA_MAMBA2_CHUNK_MIN=1 "$BIN" selftest --device cuda --fixtures tests/fixtures/tiny \
  --archs qwen3_5,qwen3_5_moe,nemotron_h,nemotron_h_moe "${scan_models[@]}" 2>&1 \
  | tee "$OUT/selftest-chunked-scans.log" || status=1

echo "== selftest, int8 activations for the Q4_K/Q6_K one-token GEMVs and the MoE pre-norm in the router (KAPITSA_GEMV_X8=1 KAPITSA_MOE_PRENORM=1) =="
KAPITSA_GEMV_X8=1 KAPITSA_MOE_PRENORM=1 "$BIN" selftest --device cuda --fixtures tests/fixtures/tiny --archs qwen3_5_moe \
  "${models[@]}" 2>&1 | tee "$OUT/selftest-x8.log" || status=1

echo "== --gpu-memory: a budget too small fails before loading; one that fits holds =="
q36=""
for m in "${models[@]}"; do [[ "$m" == *qwen3.6* ]] && q36="$m"; done
if [[ -n "$q36" ]]; then
  if "$BIN" bench -m "$q36" --device cuda --gpu-memory 1GiB -p 16 -n 0 -r 1 \
      >"$OUT/budget-small.log" 2>&1; then
    echo "FAIL --gpu-memory 1GiB ran a $(du -h "$q36" | cut -f1) file"; status=1
  elif grep -q panicked "$OUT/budget-small.log" || ! grep -q "needs about" "$OUT/budget-small.log"; then
    echo "FAIL --gpu-memory 1GiB: no clear error (see budget-small.log)"; status=1
  else
    echo "ok: --gpu-memory 1GiB refused: $(grep -o 'needs about.*' "$OUT/budget-small.log" | head -1)"
  fi
  budget=$(( $(stat -c %s "$q36") / 1073741824 + 3 ))
  if "$BIN" bench -m "$q36" --device cuda --gpu-memory "${budget}GiB" -p 512 -n 16 -r 1 -o json \
      >"$OUT/budget-fits.json" 2>"$OUT/budget-fits.log"; then
    python3 - "$OUT/budget-fits.json" "$budget" <<'PY' || status=1
import json, sys
rows = json.load(open(sys.argv[1])); budget = int(sys.argv[2]) << 30
peak = max(r["gpu_mem_peak_bytes"] for r in rows)
ok = peak <= budget and all(r.get("gpu_mem_budget_bytes") == budget for r in rows)
print(("ok" if ok else "FAIL"), f": --gpu-memory {budget >> 30}GiB: peak {peak / 2**30:.2f} GiB")
sys.exit(0 if ok else 1)
PY
  else
    echo "FAIL --gpu-memory ${budget}GiB did not run (see budget-fits.log)"; status=1
  fi
fi

echo "== serve --device cuda =="
PORT=18931
"$BIN" serve --device cuda --gpu-memory 4GiB --model tests/fixtures/tiny/qwen2-a --port $PORT \
  >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 1
done
python3 - "$PORT" <<'PY' 2>&1 | tee "$OUT/serve-checks.log" || status=1
import json, sys, threading, urllib.error, urllib.request
port = sys.argv[1]
url = f"http://127.0.0.1:{port}/v1/completions"
def post(body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        sys.exit(f"FAIL HTTP {e.code}: {e.read().decode()}")
base = {"model": "qwen2-a", "prompt": "hello world", "max_tokens": 16, "temperature": 0}
solo = json.loads(post(base))["choices"][0]["text"]
# streaming gives the same text
chunks = [l[6:] for l in post({**base, "stream": True}).splitlines() if l.startswith("data: ")]
streamed = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if c != "[DONE]")
ok = True
if streamed != solo:
    print("FAIL streaming text differs:", repr(streamed), repr(solo)); ok = False
# 8 concurrent requests with different prompts each give their solo output
prompts = [f"prompt number {i} says" for i in range(8)]
alone = [json.loads(post({**base, "prompt": p}))["choices"][0]["text"] for p in prompts]
got = [None] * 8
def run(i):
    got[i] = json.loads(post({**base, "prompt": prompts[i]}))["choices"][0]["text"]
ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
for i in range(8):
    if got[i] != alone[i]:
        print(f"FAIL concurrent request {i} differs from its solo run"); ok = False
print("serve checks:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
if grep -q "GPU memory for the KV cache" "$OUT/serve.log"; then
  echo "ok: $(grep -o 'GPU memory for the KV cache.*' "$OUT/serve.log")"
else
  echo "FAIL serve did not size its KV cache from GPU memory (see serve.log)"; status=1
fi
kill $SERVER 2>/dev/null || true
echo "test-gpu: $([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status
