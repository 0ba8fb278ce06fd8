#!/usr/bin/env bash
# GPU call X2 (stop 43): test-gpu.sh on the fused decode launches (matmul_many grouped by
# format, up to 4 parts; router + top-k in one launch; the shared expert in the routed
# launches); tg128 of the 40-layer Qwen3.6 with the new launches on and off; an in-graph
# profile of a decode step; 16 sequences.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
el() { echo "$1 $(( $(date +%s) - t0 )) s" >> $OUT/times.txt; }
K=/tmp/k
xz -dc bench/.cache/kapitsa.xz > $K && chmod +x $K
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/gpu.txt
( $K synth --preset qwen3.6-35b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q36.gguf > /tmp/synth.log 2>&1
  touch /tmp/syn.done ) &
TEST_GPU_SYNTH="qwen3.6-35b-a3b:4 nemotron-3-nano-30b-a3b:8" KAPITSA_BIN=$K OUT=/tmp/tg timeout 230 scripts/test-gpu.sh > /tmp/test-gpu.log 2>&1
el "test-gpu rc=$?"
{ grep -E "^FAIL|passed, |test-gpu:|^== |serve checks|^ok:" /tmp/test-gpu.log; } > $OUT/summary.txt
cp /tmp/test-gpu.log $OUT/test-gpu.log
while [[ ! -f /tmp/syn.done ]]; do sleep 1; done
el synth
B() { echo "== $*" >> $OUT/bench.txt; timeout 150 $K bench -m /tmp/q36.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches" /tmp/kb.err | tail -1 >> $OUT/bench.txt; }
B -p 0 -n 128 -r 2
KAPITSA_GEMV_LPR=0 B -p 0 -n 128 -r 2
KAPITSA_MOE_SHARED_FOLD=0 B -p 0 -n 128 -r 2
KAPITSA_MOE_SHARED_FOLD=0 KAPITSA_GEMV_LPR=0 B -p 0 -n 128 -r 1
KAPITSA_GDN_FUSED=0 B -p 0 -n 128 -r 1
B -p 0 -n 128 -r 2
el k1
KAPITSA_CUDA_PROF=1 timeout 100 $K bench -m /tmp/q36.gguf --device cuda -p 0 -n 32 -r 1 > /tmp/pd.out 2>/tmp/pd.err
grep -A24 "KAPITSA_CUDA_PROF" /tmp/pd.err > $OUT/prof0.txt
el prof0
B -d 512 -p 0 -n 128 --sequences 16 -r 2
el k16
cat $OUT/gpu.txt $OUT/summary.txt $OUT/bench.txt $OUT/prof0.txt $OUT/times.txt 2>/dev/null
