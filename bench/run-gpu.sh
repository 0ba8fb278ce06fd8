#!/usr/bin/env bash
# GPU benchmark: Kapitsa (`kapitsa bench --device cuda`) against llama.cpp (`llama-bench`, CUDA)
# on the same synthetic dense GGUFs (Qwen2.5-Coder-1.5B and Qwen3-8B shapes, Q4_K_M mix, from
# `kapitsa synth`), run ON the GPU machine (an H200 with nvcc, cmake and ninja, no network).
# It mirrors bench/run.sh: both engines alternately, in rounds, on the same files, then a
# markdown report with the ratios and the share of the HBM roofline for decode.
#
# usage: bench/run-gpu.sh                   build llama.cpp (cached), write the models (cached),
#                                           measure, report
#        bench/run-gpu.sh --build-only      only the cached steps (llama.cpp build, models), to
#                                           split a first run over two calls of <= 10 minutes
#        bench/run-gpu.sh --report-only DIR rebuild the report from the results saved in DIR
#
# What travels to the GPU machine (bench/.cache is ignored by git; carry it):
#   bench/.cache/llama[-_]cpp[-_]bin-*.tar.xz   llama.cpp's source (bench/fetch-llama-src.sh, then
#                                               bench/trim-llama-src.sh to fit the 64 MiB)
#   bench/.cache/kapitsa.xz                     the kapitsa binary, built with CUDA here
#                                               (scripts/build-gpu-binary.sh)
#
# Environment (defaults in brackets):
#   OUT            results folder: raw JSON, logs, report.md [bench/results-gpu/<UTC time>]
#   KAPITSA_BIN    kapitsa binary [bench/.cache/kapitsa.xz unpacked to /tmp/kapitsa-bench if
#                  that exists, else target/release/kapitsa]
#   LLAMA_SRC_TGZ  llama.cpp source tarball [bench/.cache/llama[-_]cpp[-_]bin-*.tar.{xz,gz}]
#   LLAMA_BUILD    llama.cpp source + build folder, kept between runs [/tmp/llama-build]
#   LLAMA_TARGETS  llama.cpp targets to build [llama-bench llama-batched-bench]
#   LLAMA_CUDA     ON; OFF makes a CPU build (only for trying the script without a GPU)
#   SYNTH_DIR      where the synthetic models are written, kept between runs [/tmp/kapitsa-synth]
#   BENCH_PRESETS  `kapitsa synth` presets [qwen2.5-coder-1.5b qwen3-8b]
#   BENCH_LAYERS   layer count of the models [production]
#   BENCH_P BENCH_N  prompt lengths, generated tokens [512,4096 128]
#   BENCH_UB       llama-bench micro-batch sizes; the report takes the best per test [512,2048]
#   BENCH_R        repetitions per engine run [3]
#   BENCH_ROUNDS   rounds per model [2]: each runs both engines, in the opposite order to the
#                  round before, so a drift of the machine favours neither; repetitions pooled
#   KAPITSA_DEVICE the `kapitsa bench --device` value [cuda]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

say() { echo "run-gpu: $*" >&2; }
die() { echo "run-gpu: error: $*" >&2; exit 1; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

mode=full
report_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --report-only)
      [ $# -ge 2 ] || die "--report-only needs a results folder"
      mode=report
      report_dir="$2"
      shift 2
      ;;
    --build-only) mode=build; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

PRESETS="${BENCH_PRESETS:-qwen2.5-coder-1.5b qwen3-8b}"
LAYERS="${BENCH_LAYERS:-}"
P="${BENCH_P:-512,4096}"
N="${BENCH_N:-128}"
UBS="${BENCH_UB:-512,2048}"
R="${BENCH_R:-3}"
ROUNDS="${BENCH_ROUNDS:-2}"
LLAMA_BUILD="${LLAMA_BUILD:-/tmp/llama-build}"
LLAMA_TARGETS="${LLAMA_TARGETS:-llama-bench llama-batched-bench}"
LLAMA_CUDA="${LLAMA_CUDA:-ON}"
SYNTH_DIR="${SYNTH_DIR:-/tmp/kapitsa-synth}"
KAPITSA_DEVICE="${KAPITSA_DEVICE:-cuda}"

# ---------------------------------------------------------------------------------------------
# The report: a function of the results folder only, so --report-only can rebuild it.
# ---------------------------------------------------------------------------------------------

# report DIR: print the markdown report and write it to DIR/report.md.
report() {
  local dir="$1"
  [ -f "$dir/meta.json" ] || die "$dir has no meta.json: not a run-gpu.sh results folder"
  python3 - "$dir" <<'PY'
import glob, json, math, os, re, sys

res = sys.argv[1]
meta = json.load(open(f"{res}/meta.json"))
UBS = [int(u) for u in str(meta["ubs"]).split(",") if u.strip()]
PS = [int(p) for p in str(meta["P"]).split(",") if p.strip() and int(p) > 0]
NS = [int(n) for n in str(meta["N"]).split(",") if n.strip() and int(n) > 0]
TESTS = [("pp", p) for p in PS] + [("tg", n) for n in NS]


def load_json(path):
    """A JSON file, or None when missing or not JSON (a failed run)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def key_of(e):
    return ("pp", int(e["n_prompt"])) if int(e.get("n_prompt", 0)) > 0 else ("tg", int(e["n_gen"]))


def rounds(prefix):
    """Per round (in order): {test key: entry} of the results files PREFIX-rK.json."""
    out = []
    for k in range(1, int(meta["rounds"]) + 1):
        data = load_json(f"{prefix}-r{k}.json")
        entries = data if isinstance(data, list) else []
        out.append({key_of(e): e for e in entries if isinstance(e, dict) and "avg_ts" in e})
    return out


def pooled(rs, key):
    """Mean and sample sd of every repetition of all rounds for one test, or None."""
    xs = [x for r in rs if key in r for x in (r[key].get("samples_ts") or [r[key]["avg_ts"]])]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": m, "sd": sd, "n": len(xs)}


def fmt(p):
    return "n/a" if p is None else f"{p['mean']:,.1f} ± {p['sd']:,.1f}"


def ratio(a, b):
    return None if not a or not b or b["mean"] <= 0 else a["mean"] / b["mean"]


def fmt_r(r):
    return "n/a" if r is None else f"{r:.2f}"


TENSOR = re.compile(r"^\s+(\S+)\s+(\S+)\s+\[([0-9, ]*)\]\s+(\d+) bytes$")


def weight_bytes_per_token(inspect_txt):
    """Weights one decode step reads, from `kapitsa inspect`'s tensor table: every tensor but
    the token-embedding table (one row of it is read), unless the embedding is tied, i.e. is the
    output head too (no output.weight), in which case all of it is read."""
    tensors = {}
    try:
        for line in open(inspect_txt):
            m = TENSOR.match(line.rstrip("\n"))
            if m:
                shape = [int(x) for x in m.group(3).split(",") if x.strip()]
                tensors[m.group(1)] = (shape, int(m.group(4)))
    except OSError:
        return None
    if not tensors:
        return None
    total = sum(b for _, b in tensors.values())
    if "token_embd.weight" in tensors and "output.weight" in tensors:
        shape, b = tensors["token_embd.weight"]
        total -= b - b // max(shape[0], 1)
    return total


def launches(prefix):
    """Kernel launches per decode step as `kapitsa bench` reports them (a JSON field of the tg
    entry, or a `launches/step` figure in its log), or None."""
    names = ("launches_per_step", "launches/step", "kernel_launches_per_step", "launches_per_token")
    for k in range(1, int(meta["rounds"]) + 1):
        data = load_json(f"{prefix}-r{k}.json")
        for e in data if isinstance(data, list) else []:
            if isinstance(e, dict) and int(e.get("n_gen", 0)) > 0:
                for n in names:
                    if e.get(n) is not None:
                        return float(e[n])
        try:
            log = open(f"{prefix}-r{k}.log").read()
        except OSError:
            log = ""
        m = re.search(r"launches(?:/|_per_)step\D{0,5}([0-9][0-9.]*)", log)
        if m:
            return float(m.group(1))
    return None


hbm = load_json(f"{res}/hbm.json") or {}
bw = hbm.get("copy_bytes_per_sec")

L = []
L.append("# GPU benchmark: Kapitsa vs llama.cpp\n")
L.append(f"Written by `bench/run-gpu.sh` ({meta.get('date', '?')}); raw JSON and logs in this folder.\n")
L.append(f"- GPU: {meta.get('gpu', 'unknown')} (name, driver)")
L.append(f"- llama.cpp: {meta.get('llama_version', 'unknown')}, built with "
         f"`{meta.get('llama_cmake', '')}`; run with `GGML_CUDA_GRAPH_OPT=1`")
L.append(f"- Kapitsa: {meta.get('kapitsa_version', 'unknown')}")
if bw:
    L.append(f"- HBM copy bandwidth: {bw / 1e12:.2f} TB/s ({hbm.get('method', '?')}; "
             "bytes read + bytes written per second, best of several timed copies)")
else:
    L.append("- HBM copy bandwidth: not measured (no torch and no nvcc), so no roofline")
L.append(f"- Each engine runs {meta['R']} timed repetition(s) (after a warm-up) per test and round, "
         f"{meta['rounds']} round(s) per model in alternating order; t/s = mean ± sd over all "
         "repetitions of all rounds. llama.cpp runs once per `-ub` and the report takes, per "
         "test, the `-ub` with the higher mean.\n")
L.append("Commands, in the order they ran:\n")
L.append("```")
try:
    L.extend(l.rstrip("\n") for l in open(f"{res}/commands.txt"))
except OSError:
    L.append("(commands.txt missing)")
L.append("```\n")

L.append("## Throughput\n")
L.append("| model | test | llama.cpp t/s (best -ub) | llama.cpp by -ub | Kapitsa t/s | Kapitsa / llama.cpp | per round |")
L.append("| ----- | ---- | -----------------------: | ---------------- | ----------: | ------------------: | --------- |")
roof_rows = []
for f in meta["files"]:
    tag, name = f["tag"], f["name"]
    llama = {ub: rounds(f"{res}/llama-ub{ub}-{tag}") for ub in UBS}
    kap = rounds(f"{res}/kapitsa-{tag}")
    best = {}
    for t in TESTS:
        label = f"{t[0]}{t[1]}"
        per_ub = {ub: pooled(llama[ub], t) for ub in UBS}
        cand = [(p["mean"], ub) for ub, p in per_ub.items() if p]
        ub_best = max(cand)[1] if cand else None
        lb = per_ub.get(ub_best) if ub_best else None
        kb = pooled(kap, t)
        best[t] = (lb, kb)
        by_ub = " / ".join(f"{ub}: {per_ub[ub]['mean']:,.0f}" if per_ub[ub] else f"{ub}: n/a" for ub in UBS)
        per_round = []
        for k in range(int(meta["rounds"])):
            lk = [llama[ub][k][t]["avg_ts"] for ub in UBS if t in llama[ub][k]]
            kk = kap[k][t]["avg_ts"] if t in kap[k] else None
            per_round.append(fmt_r(kk / max(lk)) if lk and kk else "n/a")
        L.append(f"| {name} | {label} | {fmt(lb)}{f' (ub {ub_best})' if lb else ''} | {by_ub} | "
                 f"{fmt(kb)} | {fmt_r(ratio(kb, lb))} | {', '.join(per_round)} |")
    roof_rows.append((f, best, launches(f"{res}/kapitsa-{tag}")))

L.append("\n## Decode against the HBM roofline\n")
L.append("Weights per token: the bytes of every tensor of the file except the token-embedding "
         "table (a decode step reads one row of it), except when the embedding is tied (no "
         "`output.weight`: it is the output head, read whole). KV-cache reads (at most "
         f"{max(PS + NS)} positions) are left out. Roofline t/s = HBM copy bandwidth / weights "
         "per token; *of roofline* = measured t/s / roofline t/s. Launches/step: kernel launches "
         "per decode step as `kapitsa bench` reports them (n/a when it does not).\n")
L.append("| model | weights / token | roofline t/s | test | llama.cpp t/s | of roofline | Kapitsa t/s | of roofline | Kapitsa launches/step |")
L.append("| ----- | --------------: | -----------: | ---- | ------------: | ----------: | ----------: | ----------: | --------------------: |")
for f, best, nl in roof_rows:
    wb = weight_bytes_per_token(f"{res}/inspect-{f['tag']}.txt")
    roof = bw / wb if bw and wb else None
    for t in [t for t in TESTS if t[0] == "tg"]:
        lb, kb = best[t]
        share = lambda p: f"{p['mean'] / roof:.0%}" if p and roof else "n/a"
        L.append(f"| {f['name']} | {f'{wb / 1e9:.3f} GB' if wb else 'n/a'} | "
                 f"{f'{roof:,.0f}' if roof else 'n/a'} | tg{t[1]} | {fmt(lb)} | {share(lb)} | "
                 f"{fmt(kb)} | {share(kb)} | {'n/a' if nl is None else f'{nl:g}'} |")

failed = sorted(os.path.basename(p)[: -len(".failed")] for p in glob.glob(f"{res}/*.failed"))
if failed:
    L.append("\nRuns that failed (their cells read n/a; see the .log files): " + ", ".join(failed) + ".")
L.append("\nModels:\n")
for f in meta["files"]:
    layers = f" --layers {f['layers']}" if f.get("layers") else ""
    L.append(f"- {f['name']}: `kapitsa synth --preset {f['preset']}{layers} --quant q4_k_m`, "
             f"{int(f['size']):,} bytes")
L.append("\nRebuild this report with `bench/run-gpu.sh --report-only DIR`.")
text = "\n".join(L) + "\n"
with open(f"{res}/report.md", "w") as out:
    out.write(text)
print(text, end="")
PY
}

if [ "$mode" = report ]; then
  report "$report_dir"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# Setup: binaries, CUDA paths, results folder.
# ---------------------------------------------------------------------------------------------

for v in "$R" "$ROUNDS"; do
  case "$v" in '' | *[!0-9]* | 0) die "BENCH_R and BENCH_ROUNDS must be counts >= 1" ;; esac
done

# nvcc for the llama.cpp build; cuBLAS & co. for kapitsa (cudarc loads them at run time).
# Never /usr/local/cuda*/compat: it holds an older libcuda than the running driver.
cuda_paths() {
  local d
  if ! command -v nvcc >/dev/null 2>&1; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
      [ -x "$d/nvcc" ] && { PATH="$d:$PATH"; break; }
    done
  fi
  for d in /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  export PATH LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
}

# Sets $kapitsa: KAPITSA_BIN, else the carried bench/.cache/kapitsa.xz, else a local build.
find_kapitsa() {
  if [ -n "${KAPITSA_BIN:-}" ]; then
    kapitsa="$KAPITSA_BIN"
  elif [ -f bench/.cache/kapitsa.xz ]; then
    kapitsa=/tmp/kapitsa-bench
    xz -dc bench/.cache/kapitsa.xz >"$kapitsa.tmp"
    chmod +x "$kapitsa.tmp"
    mv "$kapitsa.tmp" "$kapitsa"
  else
    kapitsa="$root/target/release/kapitsa"
  fi
  [ -x "$kapitsa" ] || die "no kapitsa binary at $kapitsa (set KAPITSA_BIN or carry bench/.cache/kapitsa.xz)"
}

# Run a command, logging it to commands.txt (with the environment it needs).
logged() {
  printf '%s\n' "$*" >>"$cmdlog"
  "$@"
}

# ---------------------------------------------------------------------------------------------
# llama.cpp: unpack the sdist and build the CUDA tools (cached in $LLAMA_BUILD).
# ---------------------------------------------------------------------------------------------

# Sets $llama_src (the llama.cpp source tree) and $llama_bin (its build's bin folder).
build_llama() {
  local tgz="${LLAMA_SRC_TGZ:-}" name stamp flags
  if [ -z "$tgz" ]; then
    # The newest version (an unmatched pattern stays literal and fails the -f test below).
    tgz=$(printf '%s\n' bench/.cache/llama[-_]cpp[-_]bin-*.tar.[gx]z | sort -V | tail -n1)
  fi
  if [ -z "$tgz" ] || [ ! -f "$tgz" ]; then
    die "no llama.cpp source tarball (run bench/fetch-llama-src.sh here and carry bench/.cache, or set LLAMA_SRC_TGZ)"
  fi
  name=$(basename "$tgz"); name=${name%.tar.*}
  llama_src="$LLAMA_BUILD/src/$name/llama.cpp"
  if [ ! -f "$llama_src/CMakeLists.txt" ]; then
    say "unpacking $tgz into $LLAMA_BUILD/src"
    mkdir -p "$LLAMA_BUILD/src"
    tar -xf "$tgz" -C "$LLAMA_BUILD/src"
    [ -f "$llama_src/CMakeLists.txt" ] || die "$tgz has no $name/llama.cpp/CMakeLists.txt"
  fi
  flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF)
  if [ "$LLAMA_CUDA" = ON ]; then
    flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a)
  else
    flags+=(-DGGML_CUDA=OFF)
  fi
  llama_cmake="cmake -G Ninja ${flags[*]}"
  llama_bin="$LLAMA_BUILD/build-$name/bin"
  stamp="$LLAMA_BUILD/build-$name/.kapitsa-stamp"
  local want="$llama_cmake | $LLAMA_TARGETS"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$llama_bin/llama-bench" ]; then
    say "llama.cpp: using the build in $LLAMA_BUILD/build-$name"
    return 0
  fi
  command -v cmake >/dev/null 2>&1 || die "cmake not found"
  command -v ninja >/dev/null 2>&1 || die "ninja not found"
  say "building llama.cpp ($LLAMA_TARGETS) in $LLAMA_BUILD/build-$name (a few minutes)"
  local t0=$SECONDS
  cmake -S "$llama_src" -B "$LLAMA_BUILD/build-$name" -G Ninja "${flags[@]}" \
    >"$LLAMA_BUILD/cmake-configure.log" 2>&1 ||
    { tail -20 "$LLAMA_BUILD/cmake-configure.log" >&2; die "llama.cpp configure failed"; }
  # shellcheck disable=SC2086  # LLAMA_TARGETS is a word list
  cmake --build "$LLAMA_BUILD/build-$name" -j "$(nproc)" --target $LLAMA_TARGETS \
    >"$LLAMA_BUILD/cmake-build.log" 2>&1 ||
    { tail -30 "$LLAMA_BUILD/cmake-build.log" >&2; die "llama.cpp build failed"; }
  echo "$want" >"$stamp"
  say "llama.cpp built in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------------
# Models: the synthetic files (cached in $SYNTH_DIR).
# ---------------------------------------------------------------------------------------------

# model_path PRESET: where the synthetic file of PRESET goes.
model_path() {
  echo "$SYNTH_DIR/$1${LAYERS:+-L$LAYERS}-q4_k_m.gguf"
}

make_models() {
  local vocab="$llama_src/models/ggml-vocab-qwen2.gguf" preset out
  [ -f "$vocab" ] || die "no $vocab in the llama.cpp source"
  mkdir -p "$SYNTH_DIR"
  for preset in $PRESETS; do
    out=$(model_path "$preset")
    [ -f "$out" ] && continue
    say "writing $out"
    "$kapitsa" synth --preset "$preset" ${LAYERS:+--layers "$LAYERS"} --quant q4_k_m \
      --tokenizer-from "$vocab" -o "$out" >&2 || die "kapitsa synth failed for $preset"
  done
}

# ---------------------------------------------------------------------------------------------
# HBM bandwidth: timed device-to-device copies (torch, else a small nvcc-built program).
# ---------------------------------------------------------------------------------------------

# measure_hbm FILE: write {"copy_bytes_per_sec": ..., "method": ...} to FILE ({} if neither
# torch nor nvcc works).
measure_hbm() {
  local outf="$1" tmp
  if python3 - "$outf" <<'PY' 2>/dev/null; then
import json, sys
import torch

n = 2 << 30  # 2 GiB per buffer: far above the 50 MB L2
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
best = 0.0
for _ in range(5):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    secs = s.elapsed_time(e) / 1e3 / 10
    best = max(best, 2 * n / secs)  # read + write
json.dump({"copy_bytes_per_sec": best, "method": f"torch {torch.__version__} copy_ of 2 GiB"},
          open(sys.argv[1], "w"))
PY
    return 0
  fi
  tmp=$(mktemp -d)
  cat >"$tmp/membw.cu" <<'CU'
// Device-to-device copy bandwidth: best of 5 timings of 10 cudaMemcpy of 2 GiB.
#include <cstdio>
#include <cuda_runtime.h>
int main() {
  const size_t n = size_t(2) << 30;
  void *a, *b;
  if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) return 1;
  for (int i = 0; i < 3; i++) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
  cudaEvent_t s, e;
  cudaEventCreate(&s);
  cudaEventCreate(&e);
  double best = 0;
  for (int t = 0; t < 5; t++) {
    cudaEventRecord(s);
    for (int i = 0; i < 10; i++) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    float ms = 0;
    cudaEventElapsedTime(&ms, s, e);
    double bw = 2.0 * n / (ms / 1e3 / 10);
    if (bw > best) best = bw;
  }
  printf("%.0f\n", best);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
CU
  local bwv
  if command -v nvcc >/dev/null 2>&1 && nvcc -O2 -o "$tmp/membw" "$tmp/membw.cu" >/dev/null 2>&1 &&
    bwv=$("$tmp/membw"); then
    printf '{"copy_bytes_per_sec": %s, "method": "cudaMemcpy device-to-device of 2 GiB"}\n' "$bwv" >"$outf"
  else
    say "warning: no torch and no working nvcc: HBM bandwidth not measured"
    echo '{}' >"$outf"
  fi
  rm -rf "$tmp"
}

# ---------------------------------------------------------------------------------------------
# Measurements.
# ---------------------------------------------------------------------------------------------

# run_one NAME CMD...: run a benchmark command, JSON to $results/NAME.json, stderr to NAME.log;
# a failure leaves NAME.failed and the run goes on (the report shows n/a).
run_one() {
  local name="$1"
  shift
  say "$name"
  if ! logged "$@" >"$results/$name.json" 2>"$results/$name.log"; then
    say "warning: $name failed (see $results/$name.log):"
    tail -5 "$results/$name.log" >&2 || true
    touch "$results/$name.failed"
    failures=$((failures + 1))
  fi
}

run_llama() { # FILE TAG ROUND
  local ub
  for ub in ${UBS//,/ }; do
    run_one "llama-ub$ub-$2-r$3" env GGML_CUDA_GRAPH_OPT=1 "$llama_bin/llama-bench" -m "$1" \
      -ngl 99 -fa 1 -p "$P" -n "$N" -ub "$ub" -r "$R" -o json
  done
}

run_kapitsa() { # FILE TAG ROUND
  run_one "kapitsa-$2-r$3" "$kapitsa" bench -m "$1" --device "$KAPITSA_DEVICE" -p "$P" -n "$N" \
    -r "$R" -o json
}

# write_meta FILE: what the report needs besides the measurements.
write_meta() {
  local gpu llama_version kapitsa_version files=() preset f
  gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)
  llama_version=$("$llama_bin/llama-bench" --version 2>&1 | grep -m1 -i version || echo unknown)
  kapitsa_version=$("$kapitsa" --version 2>/dev/null || echo unknown)
  for preset in $PRESETS; do
    f=$(model_path "$preset")
    files+=("$preset" "$f" "$(stat -c %s "$f")")
  done
  python3 - "$1" "${gpu:-unknown}" "$llama_version" "$kapitsa_version" "$llama_cmake" \
    "$P" "$N" "$UBS" "$R" "$ROUNDS" "$LAYERS" "${files[@]}" <<'PY'
import datetime, json, sys

(out, gpu, llama_version, kapitsa_version, llama_cmake, P, N, ubs, R, rounds, layers, *rest) = sys.argv[1:]
files = []
for i in range(0, len(rest), 3):
    preset, path, size = rest[i:i + 3]
    files.append({"tag": f"{i // 3 + 1:02d}", "preset": preset, "name": preset, "path": path,
                  "size": int(size), "layers": int(layers) if layers else None})
meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu, "llama_version": llama_version.strip(), "kapitsa_version": kapitsa_version.strip(),
        "llama_cmake": llama_cmake, "P": P, "N": N, "ubs": ubs, "R": R, "rounds": rounds,
        "files": files}
json.dump(meta, open(out, "w"), indent=1)
PY
}

# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------

cuda_paths
find_kapitsa
build_llama
make_models
if [ "$mode" = build ]; then
  say "done: llama.cpp in $llama_bin, models in $SYNTH_DIR"
  exit 0
fi

results="${OUT:-$root/bench/results-gpu/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$results"
cmdlog="$results/commands.txt"
: >"$cmdlog"
failures=0

nvidia-smi >"$results/nvidia-smi.txt" 2>&1 || true
write_meta "$results/meta.json"
say "HBM bandwidth"
measure_hbm "$results/hbm.json"

i=0
n_run=0
for preset in $PRESETS; do
  i=$((i + 1))
  tag=$(printf '%02d' "$i")
  f=$(model_path "$preset")
  "$kapitsa" inspect "$f" >"$results/inspect-$tag.txt"
  for k in $(seq "$ROUNDS"); do
    # Alternate which engine goes first, so a drift of the machine favours neither.
    n_run=$((n_run + 1))
    if [ $((n_run % 2)) -eq 1 ]; then
      run_llama "$f" "$tag" "$k"
      run_kapitsa "$f" "$tag" "$k"
    else
      run_kapitsa "$f" "$tag" "$k"
      run_llama "$f" "$tag" "$k"
    fi
  done
done

report "$results"
say "done: $results/report.md ($failures failed run(s))"
[ "$failures" -eq 0 ]
