#!/usr/bin/env bash
# GPU call X4 (stop 43): the final defaults (the MoE pre-norm fusion off) on the 40-layer
# Qwen3.6 and the 48-layer Qwen3-30B-A3B, tg128; the fusion on once more.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
el() { echo "$1 $(( $(date +%s) - t0 )) s" >> $OUT/times.txt; }
K=/tmp/k
xz -dc bench/.cache/kapitsa.xz > $K && chmod +x $K
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/gpu.txt
$K synth --preset qwen3.6-35b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q36.gguf > /tmp/synth.log 2>&1 &
$K synth --preset qwen3-30b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q30.gguf >> /tmp/synth2.log 2>&1 &
wait
el synth
B() { m=$1; shift; echo "== $m $*" >> $OUT/bench.txt; timeout 100 $K bench -m /tmp/$m.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches" /tmp/kb.err | tail -1 >> $OUT/bench.txt; }
B q36 -p 0 -n 128 -r 2
B q30 -p 0 -n 128 -r 2
KAPITSA_MOE_NORM=1 B q36 -p 0 -n 128 -r 1
KAPITSA_MOE_ROUTER_FUSED=0 B q30 -p 0 -n 128 -r 1
el k
cat $OUT/gpu.txt $OUT/bench.txt $OUT/times.txt
