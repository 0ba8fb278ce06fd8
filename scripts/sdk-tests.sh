#!/usr/bin/env bash
# Run the OpenAI and Anthropic Python SDK tests (tests/sdk) against `kapitsa serve`.
#
#   scripts/sdk-tests.sh MODEL_PATH [pytest args...]
#
# Creates (once) a virtualenv with openai, anthropic, pytest, jsonschema and httpx (for the
# load test, tests/sdk/test_load.py -> bench/load.py) under
# ${KAPITSA_CACHE:-~/.cache/kapitsa}/sdkvenv, builds kapitsa (release), starts `kapitsa serve` on
# a free port with an API key, waits for /health, runs pytest, then stops the server with
# SIGTERM and checks that it exits cleanly (graceful shutdown). The server log is kept in
# $KAPITSA_CACHE/sdk-server.log.
#
# When tests/fixtures/tiny/qwen35-vl-a exists, a second server on that tiny vision-language model
# (with --allow-image-urls) serves tests/sdk/test_vision.py; its address is KAPITSA_VL_BASE_URL
# (same API key) and its log $KAPITSA_CACHE/sdk-vl-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: scripts/sdk-tests.sh MODEL_PATH [pytest args...]}"
shift
cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}"
venv="$cache/sdkvenv"
mkdir -p "$cache"

if ! "$venv/bin/python" -c "import openai, anthropic, pytest, jsonschema, httpx" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check openai anthropic pytest jsonschema httpx
fi

cargo build --release -q -p kapitsa-cli
bin="${CARGO_TARGET_DIR:-target}/release/kapitsa"

port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
key="sdk-test-$RANDOM$RANDOM"
log="$cache/sdk-server.log"
"$bin" serve --model "$model" --host 127.0.0.1 --port "$port" --api-key "$key" \
  --ctx-size 4096 --max-running 4 --shutdown-grace 5 >"$log" 2>&1 &
pid=$!

vl_model=tests/fixtures/tiny/qwen35-vl-a
vl_pid=""
vl_url=""
vl_log="$cache/sdk-vl-server.log"
if [ -f "$vl_model/model.safetensors" ]; then
  vl_port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$bin" serve --model "$vl_model" --model-name tiny-vl --host 127.0.0.1 --port "$vl_port" \
    --api-key "$key" --ctx-size 2048 --max-running 2 --threads 2 --allow-image-urls \
    --shutdown-grace 2 >"$vl_log" 2>&1 &
  vl_pid=$!
  vl_url="http://127.0.0.1:$vl_port"
fi

stopped=0
stop_server() {
  if [ -n "$vl_pid" ]; then
    kill -TERM "$vl_pid" 2>/dev/null || true
    wait "$vl_pid" || true
    vl_pid=""
  fi
  if [ "$stopped" = 0 ]; then
    stopped=1
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid"
  fi
}
trap 'stop_server || true' EXIT

for _ in $(seq 1 600); do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "kapitsa serve exited early:" >&2
    cat "$log" >&2
    exit 1
  fi
  if curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
    break
  fi
  sleep 0.5
done
curl -fsS "http://127.0.0.1:$port/health" >/dev/null || { echo "server not healthy" >&2; cat "$log" >&2; exit 1; }
if [ -n "$vl_pid" ]; then
  for _ in $(seq 1 120); do
    curl -fsS "$vl_url/health" >/dev/null 2>&1 && break
    kill -0 "$vl_pid" 2>/dev/null || break
    sleep 0.5
  done
  curl -fsS "$vl_url/health" >/dev/null || { echo "the vision-language server is not healthy:" >&2; cat "$vl_log" >&2; exit 1; }
fi

status=0
KAPITSA_VL_BASE_URL="$vl_url" KAPITSA_BASE_URL="http://127.0.0.1:$port" KAPITSA_API_KEY="$key" KAPITSA_SERVER_PID="$pid" KAPITSA_SERVER_LOG="$log" \
  "$venv/bin/python" -m pytest -v -rxX -p no:cacheprovider tests/sdk "$@" || status=$?

server_status=0
stop_server || server_status=$?
trap - EXIT
if [ "$server_status" != 0 ]; then
  echo "kapitsa serve exited with status $server_status after SIGTERM (expected 0):" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
echo "kapitsa serve stopped cleanly on SIGTERM"
exit "$status"
