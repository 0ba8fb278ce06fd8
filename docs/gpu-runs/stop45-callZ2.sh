#!/usr/bin/env bash
# GPU call Z2 (stop 45): test-gpu.sh on the final kernels (x8_store with the fast reciprocal
# and the pre-norm's 8 reductions side by side); Qwen3.6 and Qwen3-30B-A3B tg128 with the
# defaults, without the router's pre-norm (KAPITSA_MOE_PRENORM=0) and without the int8 rows
# (KAPITSA_GEMV_X8=0); the in-graph step profile.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
el() { echo "$1 $(( $(date +%s) - t0 )) s" >> $OUT/times.txt; }
K=/tmp/k
xz -dc bench/.cache/kapitsa.xz > $K && chmod +x $K
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/gpu.txt
( for p in qwen3.6-35b-a3b:q36 qwen3-30b-a3b:q30; do
    $K synth --preset ${p%%:*} --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/${p##*:}.gguf >> /tmp/synth.log 2>&1
    touch /tmp/syn.${p##*:}
  done ) &
TEST_GPU_SYNTH="qwen3.6-35b-a3b:4 qwen3-30b-a3b:4 nemotron-3-nano-30b-a3b:8" KAPITSA_BIN=$K OUT=/tmp/tg timeout 240 scripts/test-gpu.sh > /tmp/test-gpu.log 2>&1
el "test-gpu rc=$?"
{ grep -E "^FAIL|passed, |test-gpu:|^== |serve checks|^ok:|normed" /tmp/test-gpu.log; } > $OUT/summary.txt
cp /tmp/test-gpu.log $OUT/test-gpu.log
B() { m=$1; shift; while [[ ! -f /tmp/syn.$m ]]; do sleep 1; done; echo "== $m $* $(env | grep -o 'KAPITSA_[A-Z_0-9]*=[a-z0-9]*' | tr '\n' ' ')" >> $OUT/bench.txt; timeout 150 $K bench -m /tmp/$m.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches|peak" /tmp/kb.err | tail -2 >> $OUT/bench.txt; }
B q36 -p 0 -n 128 -r 2
KAPITSA_MOE_PRENORM=0 B q36 -p 0 -n 128 -r 2
B q30 -p 0 -n 128 -r 2
KAPITSA_MOE_PRENORM=0 B q30 -p 0 -n 128 -r 2
el k1
KAPITSA_CUDA_PROF=1 timeout 60 $K bench -m /tmp/q36.gguf --device cuda -p 0 -n 32 -r 1 > /tmp/pd.out 2>/tmp/pd.err
grep -A24 "KAPITSA_CUDA_PROF" /tmp/pd.err >> $OUT/prof.txt
el prof
KAPITSA_GEMV_X8=0 B q36 -p 0 -n 128 -r 2
B q36 -d 512 -p 0 -n 128 --sequences 16 -r 1
el k2
cat $OUT/gpu.txt $OUT/summary.txt $OUT/bench.txt $OUT/prof.txt $OUT/times.txt 2>/dev/null
