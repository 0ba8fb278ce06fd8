#!/usr/bin/env bash
# Install NVIDIA's nvcc from PyPI (no CUDA toolkit, no GPU needed) so that
# `cargo build --features cuda` can compile crates/backend-cuda/kernels/*.cu to sm_90a cubins.
#
# The five wheels are pinned to CUDA 13.0 (driver 580 runs 13.0 PTX/cubins; an unpinned
# `nvidia-cuda-nvcc` pulls 13.5 parts whose PTX the driver rejects). They go into a venv at
# ${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/nvcc/venv; ${...}/nvcc/bin/nvcc is made a wrapper that runs
# the venv's nvcc, which is where crates/backend-cuda/build.rs looks when neither $NVCC nor an
# nvcc on PATH is set. Idempotent: a second run only checks the versions. Prints the nvcc path.
set -euo pipefail

ROOT="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/nvcc"
VENV="$ROOT/venv"
PKGS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
)
PY="${PYTHON:-python3}"

# Already installed with exactly these versions? (a stamp written after a successful install)
STAMP="$ROOT/installed.txt"
WANT="$(printf '%s\n' "${PKGS[@]}")"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$ROOT/bin/nvcc" ]] && "$ROOT/bin/nvcc" --version >/dev/null 2>&1; then
  echo "$ROOT/bin/nvcc"
  exit 0
fi

mkdir -p "$ROOT/bin"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PKGS[@]}" >&2

# The wheels put the toolkit under site-packages/nvidia/cu13 (bin/nvcc, include, nvvm, ...).
CU13="$("$VENV/bin/python" - <<'EOF'
import glob, os, sys
hits = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "cu13", "bin", "nvcc"))
print(os.path.dirname(os.path.dirname(hits[0])) if hits else "")
EOF
)"
if [[ -z "$CU13" || ! -x "$CU13/bin/nvcc" ]]; then
  echo "install-nvcc: nvcc not found in $VENV after pip install" >&2
  exit 1
fi
# A wrapper, not a symlink: nvcc finds nvcc.profile (and through it the headers, ptxas and
# cicc) relative to the path it was started by, which a symlink would hide.
rm -f "$ROOT/bin/nvcc"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$CU13/bin/nvcc" >"$ROOT/bin/nvcc"
chmod +x "$ROOT/bin/nvcc"
"$ROOT/bin/nvcc" --version >&2
printf '%s\n' "${PKGS[@]}" >"$STAMP"
echo "$ROOT/bin/nvcc"
