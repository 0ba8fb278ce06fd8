#!/usr/bin/env bash
# CPU A/B of two kapitsa binaries (before and after a change) on the same files, alternating
# rounds so a drift of the machine favours neither: the regression check of a change that
# should not move CPU speed. Prints one line per run and, per file and test, the mean t/s of
# each binary and their ratio.
#
# usage: bench/ab-cpu.sh OLD_KAPITSA NEW_KAPITSA FILE.gguf [FILE.gguf ...]
# Environment: AB_ROUNDS [2], AB_ARGS [-p 512 -n 128 -r 3 -t 2 --load-mode memory].
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,9p "$0"; exit 2; }
old=$1 new=$2
shift 2
rounds=${AB_ROUNDS:-2}
read -r -a args <<<"${AB_ARGS:--p 512 -n 128 -r 3 -t 2 --load-mode memory}"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for f in "$@"; do
  for r in $(seq 1 "$rounds"); do
    order=("old:$old" "new:$new")
    [ $((r % 2)) = 0 ] && order=("new:$new" "old:$old")
    for which in "${order[@]}"; do
      name=${which%%:*} bin=${which#*:}
      # `kapitsa bench` prints llama-bench's table: `| model | ... | test | t/s |`.
      "$bin" bench -m "$f" "${args[@]}" 2>/dev/null | awk -v n="$name" -v f="$(basename "$f")" -F'|' \
        '/ (pp|tg)[0-9]+ / { gsub(/ /, "", $(NF-2)); split($(NF-1), a, "±"); gsub(/ /, "", a[1]);
          print f, n, $(NF-2), a[1] }' | tee -a "$results"
    done
  done
done
echo "--- mean t/s over rounds: file test old new new/old"
awk '{ k = $1 " " $3; s[k " " $2] += $4; c[k " " $2]++; keys[k] = 1 }
  END { for (k in keys) { o = s[k " old"] / c[k " old"]; n = s[k " new"] / c[k " new"];
        printf "%s %.2f %.2f %.3f\n", k, o, n, n / o } }' "$results" | sort
