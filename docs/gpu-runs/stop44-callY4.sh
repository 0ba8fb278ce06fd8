#!/usr/bin/env bash
# GPU call Y4 (stop 44, the final binary): test-gpu.sh; the 40-layer Qwen3.6 and Qwen3-30B-A3B
# tg128 with the final defaults (gemv_id5_q4_k on, gemv_id_sum only for down rows of <= 8
# chunks) and with call Y3's (KAPITSA_GEMV_ID5=0), and 16 streams.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
el() { echo "$1 $(( $(date +%s) - t0 )) s" >> $OUT/times.txt; }
K=/tmp/k
xz -dc bench/.cache/kapitsa.xz > $K && chmod +x $K
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/gpu.txt
( $K synth --preset qwen3.6-35b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q36.gguf > /tmp/synth.log 2>&1
  $K synth --preset qwen3-30b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q30.gguf >> /tmp/synth.log 2>&1
  touch /tmp/syn.done ) &
TEST_GPU_SYNTH="qwen3.6-35b-a3b:4 qwen3-30b-a3b:4 nemotron-3-nano-30b-a3b:8" KAPITSA_BIN=$K OUT=/tmp/tg timeout 240 scripts/test-gpu.sh > /tmp/test-gpu.log 2>&1
el "test-gpu rc=$?"
{ grep -E "^FAIL|passed, |test-gpu:|^== |serve checks|^ok:" /tmp/test-gpu.log; } > $OUT/summary.txt
cp /tmp/test-gpu.log $OUT/test-gpu.log
while [[ ! -f /tmp/syn.done ]]; do sleep 1; done
el synth
B() { m=$1; shift; echo "== $m $* $(env | grep -o 'KAPITSA_[A-Z_0-9]*=[0-9]' | tr '\n' ' ')" >> $OUT/bench.txt; timeout 150 $K bench -m /tmp/$m.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches|peak" /tmp/kb.err | tail -2 >> $OUT/bench.txt; }
B q36 -p 0 -n 128 -r 2
KAPITSA_GEMV_ID5=0 B q36 -p 0 -n 128 -r 2
B q30 -p 0 -n 128 -r 2
KAPITSA_GEMV_ID5=0 B q30 -p 0 -n 128 -r 2
B q36 -d 512 -p 0 -n 128 --sequences 16 -r 1
el k1
cat $OUT/gpu.txt $OUT/summary.txt $OUT/bench.txt $OUT/times.txt 2>/dev/null
