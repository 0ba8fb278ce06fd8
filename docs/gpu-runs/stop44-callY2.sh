#!/usr/bin/env bash
# GPU call Y2 (stop 44): test-gpu.sh with the CUDA matmul_many override and the routed down
# projections summed in one launch (gemv_id_sum); the 40-layer Qwen3.6
# and Qwen3-30B-A3B tg128 with each on and off (KAPITSA_MATMUL_MANY=0, KAPITSA_MOE_DOWN_SUM=0); Nsight Compute on one
# decode step of the 4-layer Qwen3.6 (true per-kernel durations, DRAM bytes and throughput,
# stall reasons of the routed GEMV) and the in-graph profile of the 40-layer file.
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
TEST_GPU_SYNTH="qwen3.6-35b-a3b:4 nemotron-3-nano-30b-a3b:8" KAPITSA_BIN=$K OUT=/tmp/tg timeout 230 scripts/test-gpu.sh > /tmp/test-gpu.log 2>&1
el "test-gpu rc=$?"
{ grep -E "^FAIL|passed, |test-gpu:|^== |serve checks|^ok:" /tmp/test-gpu.log; } > $OUT/summary.txt
cp /tmp/test-gpu.log $OUT/test-gpu.log
L4=/tmp/kapitsa-syn-qwen3.6-35b-a3b-L4.gguf
NCU="ncu --clock-control none -k regex:gemv|moe_|gdn_fused|rms_norm|attn_|quantize|mul_sigmoid|rope|kv_write|split_cols"
KAPITSA_CUDA_GRAPHS=0 timeout 200 $NCU --launch-skip 400 --launch-count 60 --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers \
  $K bench -m $L4 --device cuda -p 0 -n 24 -r 1 > $OUT/ncu-metrics.csv 2>/tmp/ncu1.err
el "ncu1 rc=$?"
tail -5 /tmp/ncu1.err > $OUT/ncu1.err
KAPITSA_CUDA_GRAPHS=0 timeout 150 ncu --clock-control none -k regex:gemv_id --launch-skip 40 --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
  $K bench -m $L4 --device cuda -p 0 -n 24 -r 1 > $OUT/ncu-gemv-id.txt 2>/tmp/ncu2.err
el "ncu2 rc=$?"
while [[ ! -f /tmp/syn.done ]]; do sleep 1; done
el synth
B() { m=$1; shift; echo "== $m $* $(env | grep -o 'KAPITSA_[A-Z_]*=0' | tr '\n' ' ')" >> $OUT/bench.txt; timeout 150 $K bench -m /tmp/$m.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches|peak" /tmp/kb.err | tail -2 >> $OUT/bench.txt; }
B q36 -p 0 -n 128 -r 2
KAPITSA_MOE_DOWN_SUM=0 B q36 -p 0 -n 128 -r 2
KAPITSA_MATMUL_MANY=0 B q36 -p 0 -n 128 -r 2
B q30 -p 0 -n 128 -r 2
KAPITSA_MOE_DOWN_SUM=0 B q30 -p 0 -n 128 -r 2
B q36 -d 512 -p 0 -n 128 --sequences 16 -r 1
KAPITSA_MOE_DOWN_SUM=0 B q36 -d 512 -p 0 -n 128 --sequences 16 -r 1
el k1
KAPITSA_CUDA_PROF=1 timeout 100 $K bench -m /tmp/q36.gguf --device cuda -p 0 -n 32 -r 1 > /tmp/pd.out 2>/tmp/pd.err
grep -A24 "KAPITSA_CUDA_PROF" /tmp/pd.err > $OUT/prof0.txt
el prof
cat $OUT/gpu.txt $OUT/summary.txt $OUT/bench.txt $OUT/prof0.txt $OUT/times.txt 2>/dev/null
