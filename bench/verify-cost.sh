#!/usr/bin/env bash
# What verifying k tokens costs against one decode step, on the production-shaped synthetic
# MoE files (random weights: acceptance on them means nothing, so the speedup is computed from
# acceptance lengths published for MTP and DFlash2), and what speedup that cost implies.
#
# usage: bench/verify-cost.sh [FILE.gguf ...]
#   default: the synthetic Qwen3.6-35B-A3B at 4 and 8 layers and Nemotron-3-Nano-30B-A3B at 8
#   and 14 layers (Q4_K_M, generated with `kapitsa synth` if missing). Two files of one preset
#   at two layer counts give a per-layer cost, from which the production layer count (40 and
#   52) is extrapolated: t(L) = fixed + L * per-layer, for every k.
#
# Environment (defaults in brackets):
#   KAPITSA_CACHE   cache folder [~/.cache/kapitsa]
#   VC_K            token counts [1,2,3,4,5,6,8,9,12,16]
#   VC_DEPTH        tokens in the cache before the measured passes [256]
#   VC_PASSES       measured passes per k [10]
#   VC_THREADS      threads [0 = one per core]
#   VC_DEVICE       kapitsa --device [cpu]
#   BENCH_OUT       the report [BENCHMARKS.md at the repository root]
#   KAPITSA_BIN     kapitsa binary [target/release/kapitsa, built if missing]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}"
ks="${VC_K:-1,2,3,4,5,6,8,9,12,16}"
depth="${VC_DEPTH:-256}"
passes="${VC_PASSES:-10}"
threads="${VC_THREADS:-0}"
device="${VC_DEVICE:-cpu}"
out_md="${BENCH_OUT:-$root/BENCHMARKS.md}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
results="$cache/bench-results/verify-cost-$stamp"
mkdir -p "$results"
say() { echo "bench/verify-cost.sh: $*" >&2; }

# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
kapitsa=$(kapitsa_binary)

if [ "$#" -eq 0 ]; then
  synth="$cache/synth"
  mkdir -p "$synth"
  tok=$(scripts/fetch-weights.sh 0.5b | tail -n1)
  gen() { # preset, layers
    local f="$synth/$1-L$2-q4_k_m.gguf" extra=()
    [ "$1" = qwen3.6-35b-a3b ] || extra=(--vocab-from-tokenizer)
    if [ ! -f "$f" ]; then
      say "generating $f"
      "$kapitsa" synth --preset "$1" --layers "$2" --quant q4_k_m --tokenizer-from "$tok" \
        "${extra[@]}" -o "$f" >&2
    fi
    echo "$f"
  }
  set -- "$(gen qwen3.6-35b-a3b 4)" "$(gen qwen3.6-35b-a3b 8)" \
    "$(gen nemotron-3-nano-30b-a3b 8)" "$(gen nemotron-3-nano-30b-a3b 14)"
fi

for f in "$@"; do
  [ -f "$f" ] || { echo "error: no such file: $f" >&2; exit 1; }
  name=$(basename "$f" .gguf)
  say "$name"
  echo "$kapitsa bench -m $f --device $device -t $threads --verify-cost $ks -d $depth -n $passes -o json" \
    >>"$results/commands.txt"
  "$kapitsa" bench -m "$f" --device "$device" -t "$threads" --verify-cost "$ks" -d "$depth" \
    -n "$passes" -o json >"$results/$name.json" 2>"$results/$name.log"
done

python3 - "$results" "$out_md" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'PY'
import glob, json, os, platform, re, sys, time

results, out_md, commit = sys.argv[1:4]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
            if l.startswith("model name")), platform.processor())
# Production layer counts of the presets (crates/synth/src/preset.rs).
PRODUCTION = {"qwen3.6-35b-a3b": 40, "nemotron-3-nano-30b-a3b": 52}

runs = {}  # (preset, layers) -> {k: ms}
backend = ""
for p in sorted(glob.glob(os.path.join(results, "*.json"))):
    rows = json.load(open(p))
    name = os.path.basename(p)[:-5]
    m = re.match(r"(.+)-L(\d+)-", name)
    key = (m.group(1), int(m.group(2))) if m else (name, 0)
    runs[key] = {r["k"]: r["ms_per_pass"] for r in rows}
    backend = rows[0]["backends"] if rows else backend

# Per preset: the measured files, and the production depth extrapolated from two of them.
tables = {}
for (preset, layers), ms in sorted(runs.items()):
    label = f"{layers} layers (measured)" if layers else "measured"
    tables.setdefault(preset, []).append((label, ms))
for preset, full in PRODUCTION.items():
    got = sorted(l for (p, l) in runs if p == preset)
    if len(got) >= 2:
        lo, hi = got[0], got[-1]
        a, b = runs[(preset, lo)], runs[(preset, hi)]
        ext = {}
        for k in a:
            if k in b:
                per_layer = (b[k] - a[k]) / (hi - lo)
                ext[k] = a[k] + (full - lo) * per_layer
        tables[preset].append((f"{full} layers (extrapolated from {lo} and {hi})", ext))

# Published acceptance (reference notes: ../shared/reference/speculative.md §2.6 and the
# numbers table). tau(d) = 1 + the expected accepted drafts of d proposals; a round of d
# drafts is one pass of d + 1 tokens.
def cumulative(pos):
    return {d: 1 + sum(pos[:d]) for d in range(1, len(pos) + 1)}

PUBLISHED = [
    ("MTP, per-position acceptance 94/86/77/68/59/51/44/38% (Qwen3.8-27B, vllm-ascend PR #14533)",
     cumulative([.94, .86, .77, .68, .59, .51, .44, .38])),
    ("MTP on Qwen3.6-35B-A3B, k=4 at 76% of drafts accepted (llama.cpp, A100; fraQtl model card)",
     {4: 1 + 4 * 0.76}),
    ("DFlash2, per-position acceptance 94/87/80/74/68/62/57/51% (Qwen3.8-27B, vllm-ascend PR #14533)",
     cumulative([.94, .87, .80, .74, .68, .62, .57, .51])),
    ("DFlash2 n-max 7, tau 3.58 (Qwen3.8-27B, llama.cpp PR #27342)", {7: 3.58}),
    ("DFlash2 n-max 15, tau 4.83 (Muse-Glimmer-30B MoE, llama.cpp PR #27342)", {15: 4.83}),
]

def cost(ms, n):
    """Pass of n tokens relative to one, interpolating linearly between measured k."""
    ks = sorted(ms)
    if n in ms:
        return ms[n] / ms[1]
    lo = max((k for k in ks if k < n), default=None)
    hi = min((k for k in ks if k > n), default=None)
    if lo is None or hi is None:
        return None
    t = ms[lo] + (ms[hi] - ms[lo]) * (n - lo) / (hi - lo)
    return t / ms[1]

L = []
L.append(f"## Verification cost on the synthetic MoE files ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n")
L.append(f"- CPU: {cpu}; backend {backend}; commit {commit}; raw results `{results.replace(os.path.expanduser('~'), '~')}`.")
L.append("- `bench/verify-cost.sh`: `kapitsa bench --verify-cost` (one sequence, logits for every row, "
         "the cache filled to 256 tokens first; mean of 10 passes after a warm-up). Random "
         "weights route tokens to random experts, so k tokens meet about as many distinct "
         "experts as real text would (the union grows with k).")
L.append("- Production depth: the per-layer cost from the two measured layer counts, times the "
         "production count, plus the fixed part (embedding, output head). Nemotron's extra blocks "
         "in the 14-layer file are 2 Mamba2, 3 MoE and 1 attention block; the production file "
         "has 23/23/6, so its row is an approximation.\n")
for preset, rows in tables.items():
    ks = sorted(set().union(*[set(ms) for _, ms in rows]))
    L.append(f"### {preset}: cost of a k-token pass relative to one token\n")
    L.append("| file | 1 token (ms) | " + " | ".join(f"k={k}" for k in ks) + " |")
    L.append("| --- | ---: | " + " | ".join("---:" for _ in ks) + " |")
    for label, ms in rows:
        L.append(f"| {label} | {ms[1]:.1f} | " + " | ".join(
            f"{ms[k] / ms[1]:.2f}" if k in ms else "-" for k in ks) + " |")
    L.append("")
    label, ms = rows[-1]
    L.append(f"Implied speedup at published acceptance lengths ({label}; the drafter's own time "
             "not counted; speedup = tau / cost of the pass):\n")
    L.append("| published acceptance | drafts d | tau | pass cost | speedup |")
    L.append("| --- | ---: | ---: | ---: | ---: |")
    for name, taus in PUBLISHED:
        best = None
        for d, tau in taus.items():
            c = cost(ms, d + 1)
            if c is None:
                continue
            s = tau / c
            if best is None or s > best[3]:
                best = (d, tau, c, s)
        if best:
            d, tau, c, s = best
            L.append(f"| {name} | {d} | {tau:.2f} | {c:.2f} | {s:.2f}x |")
    L.append("")
L.append("Where the per-position acceptance is published, the row is the best draft length d. "
         "Nemotron 3 has no published MTP acceptance (reference notes: not found); its rows "
         "apply the Qwen numbers as a what-if.\n")
text = "\n".join(L) + "\n"
print(text)
with open(out_md, "a") as f:
    f.write("\n" + text)
PY
