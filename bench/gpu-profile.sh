#!/usr/bin/env bash
# Where one decode step's time goes, per kernel, on the GPU machine: Nsight Compute (ncu,
# clocks left alone) over a window of kernel launches in the middle of `kapitsa bench -n`,
# op by op (KAPITSA_CUDA_GRAPHS=0, so every kernel is its own launch), then a table per kernel
# name: launches, total and mean time, DRAM bytes read and the bandwidth that makes.
#
# usage: bench/gpu-profile.sh MODEL.gguf [SKIP] [COUNT]   (launches skipped / profiled)
# env:   OUT (csv + table) [/tmp/kapitsa-prof], KAPITSA_BIN [/tmp/kapitsa from bench/.cache],
#        PROF_PP=N profiles a prompt of N tokens (`bench -p N -n 0`) instead of decode steps.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$1"; SKIP="${2:-3000}"; COUNT="${3:-800}"
OUT="${OUT:-/tmp/kapitsa-prof}"
mkdir -p "$OUT"
BIN="${KAPITSA_BIN:-/tmp/kapitsa}"
[[ -x "$BIN" ]] || { xz -dc bench/.cache/kapitsa.xz > "$BIN"; chmod +x "$BIN"; }
for d in /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
KAPITSA_CUDA_GRAPHS=0 "$NCU" --clock-control none --launch-skip "$SKIP" --launch-count "$COUNT" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
  "$BIN" bench -m "$MODEL" --device cuda -p "${PROF_PP:-0}" -n "$([[ -n "${PROF_PP:-}" ]] && echo 0 || echo 64)" -r 1 \
  >"$OUT/ncu.csv" 2>"$OUT/ncu.log" || true
python3 - "$OUT/ncu.csv" <<'PY' | tee "$OUT/profile.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[hdr]; ki, mi, vi, ui = (h.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
idi = h.index("ID")
per = collections.defaultdict(dict)
for r in rows[hdr + 1:]:
    if len(r) <= max(ki, mi, vi): continue
    v = float(r[vi].replace(",", "")) if r[vi] else 0.0
    unit = r[ui]
    if r[mi] == "gpu__time_duration.sum":
        # (ncu names the units either way: "nsecond" or "ns")
        v *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
    else:
        v *= {"byte": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}[unit]
    per[(r[idi], r[ki])][r[mi]] = v
agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
for (_, name), m in per.items():
    a = agg[name.split("(")[0]]
    a[0] += 1; a[1] += m.get("gpu__time_duration.sum", 0)
    a[2] += m.get("dram__bytes_read.sum", 0); a[3] += m.get("dram__bytes_write.sum", 0)
tot = sum(a[1] for a in agg.values())
print(f"{len(per)} launches, {tot:.1f} us of kernel time")
print(f"{'kernel':32} {'n':>5} {'us':>9} {'%':>5} {'us/launch':>9} {'MB read':>9} {'GB/s':>7}")
for name, a in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:32]:32} {a[0]:5d} {a[1]:9.1f} {100*a[1]/tot:5.1f} {a[1]/a[0]:9.2f} {a[2]/1e6:9.2f} {a[2]/1e3/max(a[1],1e-9):7.0f}")
PY
