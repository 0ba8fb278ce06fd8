# Helpers shared by the bench scripts that use a prebuilt kapitsa (spec.sh, verify-cost.sh);
# sourced after the script has set `root` (the repository root).

# Prints the kapitsa binary to use: $KAPITSA_BIN, else target/release/kapitsa, built here with
# cargo if missing.
kapitsa_binary() {
  if [ -n "${KAPITSA_BIN:-}" ]; then
    [ -x "$KAPITSA_BIN" ] || { echo "error: KAPITSA_BIN=$KAPITSA_BIN is not an executable" >&2; return 1; }
    echo "$KAPITSA_BIN"
    return 0
  fi
  local bin="$root/target/release/kapitsa"
  if [ ! -x "$bin" ]; then
    echo "bench/$(basename "$0"): building kapitsa" >&2
    cargo build --release -p kapitsa-cli >&2
  fi
  echo "$bin"
}
