#!/usr/bin/env bash
# Run real clients against `kapitsa serve`, one non-interactive task each, and print what
# each did.
#
#   scripts/clients.sh MODEL_PATH [CLIENT...]     (clients: codex claude aider litellm fim)
#
# Installs (once) into ${KAPITSA_CACHE:-~/.cache/kapitsa}/clients: the npm packages
# @openai/codex and @anthropic-ai/claude-code, and virtualenvs with aider-chat and with
# litellm[proxy]. Builds kapitsa (release), starts a fresh server on a free port with an API
# key, then:
#   codex    Codex CLI `exec` through a custom provider (wire_api = "responses")
#   claude   Claude Code `-p` with its default tools and thinking (ANTHROPIC_BASE_URL)
#   aider    aider `--message` editing a file (OpenAI-compatible API)
#   litellm  the LiteLLM proxy with openai/, hosted_vllm/ and anthropic/ models pointing at the
#            server, asked through its chat completions and /v1/responses routes
#   fim      fill-in-the-middle through /v1/completions suffix, /infill and /api/generate
# The task logs go to $cache/clients/logs; the last lines list each client's result. A client
# that needs to reach its vendor's servers (telemetry, update checks, login) may fail on a
# machine without that network: the log says so.
set -uo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: scripts/clients.sh MODEL_PATH [CLIENT...]}"
shift
wanted="${*:-codex claude aider litellm fim}"
cache="${KAPITSA_CACHE:-$HOME/.cache/kapitsa}/clients"
logs="$cache/logs"
mkdir -p "$cache" "$logs"

if [[ " $wanted " == *" codex "* || " $wanted " == *" claude "* ]] \
  && { [ ! -x "$cache/npm/node_modules/.bin/codex" ] || [ ! -x "$cache/npm/node_modules/.bin/claude" ]; }; then
  npm install --prefix "$cache/npm" --no-audit --no-fund @openai/codex @anthropic-ai/claude-code >"$logs/npm.log" 2>&1 \
    || echo "npm install failed: see $logs/npm.log"
fi
# aider pins its own litellm: one virtualenv each.
if [[ " $wanted " == *" aider "* ]] && ! "$cache/aider-venv/bin/python" -c "import aider" 2>/dev/null; then
  python3 -m venv "$cache/aider-venv"
  "$cache/aider-venv/bin/pip" install -q --disable-pip-version-check aider-chat >"$logs/pip-aider.log" 2>&1 \
    || echo "pip install aider-chat failed: see $logs/pip-aider.log"
fi
if [[ " $wanted " == *" litellm "* ]] && ! "$cache/litellm-venv/bin/python" -c "import litellm.proxy" 2>/dev/null; then
  python3 -m venv "$cache/litellm-venv"
  "$cache/litellm-venv/bin/pip" install -q --disable-pip-version-check 'litellm[proxy]' >"$logs/pip-litellm.log" 2>&1 \
    || echo "pip install litellm[proxy] failed: see $logs/pip-litellm.log"
fi
bin_dir="$cache/npm/node_modules/.bin"

cargo build --release -q -p kapitsa-cli
kapitsa="${CARGO_TARGET_DIR:-target}/release/kapitsa"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
key="clients-$RANDOM$RANDOM"
base="http://127.0.0.1:$port"
name="qwen-coder"
"$kapitsa" serve --model "$model" --port "$port" --api-key "$key" --model-name "$name" \
  --alias claude-opus-4-8 --alias gpt-5-codex --max-running 4 >"$logs/server.log" 2>&1 &
server=$!
pids=("$server")
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT
for _ in $(seq 1 600); do
  curl -sf "$base/health" >/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "kapitsa serve exited:"; cat "$logs/server.log"; exit 1; }
  sleep 0.5
done

work=$(mktemp -d)
mkdir -p "$work/project"
cat >"$work/project/calc.py" <<'EOF'
def add(a, b):
    return a - b


if __name__ == "__main__":
    print(add(2, 3))
EOF
results=()
record() { results+=("$1: $2"); echo "== $1: $2"; }

run_codex() {
  local home="$work/codex-home"
  mkdir -p "$home"
  cat >"$home/config.toml" <<EOF
model = "gpt-5-codex"
model_provider = "kapitsa"
[model_providers.kapitsa]
name = "kapitsa"
base_url = "$base/v1"
env_key = "KAPITSA_API_KEY"
wire_api = "responses"
EOF
  (cd "$work/project" && CODEX_HOME="$home" KAPITSA_API_KEY="$key" timeout 1500 "$bin_dir/codex" exec \
    --skip-git-repo-check --sandbox read-only "List the Python files in this directory with the shell tool, then say which one defines add()." \
    </dev/null >"$logs/codex.log" 2>&1)
  local rc=$?
  if [ $rc = 0 ]; then record codex "ok (exit 0; answer: $(tail -n 3 "$logs/codex.log" | tr '\n' ' ' | cut -c1-160))"; else record codex "FAILED (exit $rc; $(tail -n 2 "$logs/codex.log" | tr '\n' ' ' | cut -c1-200))"; fi
}

run_claude() {
  local home="$work/claude-home"
  mkdir -p "$home"
  (cd "$work/project" && CLAUDE_CONFIG_DIR="$home" ANTHROPIC_BASE_URL="$base" ANTHROPIC_API_KEY="$key" \
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1 \
    timeout 1500 "$bin_dir/claude" -p "Read calc.py and tell me in one sentence what bug add() has." \
    --output-format json </dev/null >"$logs/claude.log" 2>&1)
  local rc=$?
  if [ $rc = 0 ]; then record claude "ok (exit 0; $(tail -c 300 "$logs/claude.log" | tr '\n' ' '))"; else record claude "FAILED (exit $rc; $(tail -n 3 "$logs/claude.log" | tr '\n' ' ' | cut -c1-300))"; fi
}

run_aider() {
  (cd "$work/project" && OPENAI_API_KEY="$key" timeout 600 "$cache/aider-venv/bin/aider" --model "openai/$name" \
    --openai-api-base "$base/v1" --no-git --yes-always --no-check-update --analytics-disable \
    --no-show-model-warnings --no-pretty --no-stream --message "Fix the bug in add() in calc.py: it must return a + b." calc.py \
    </dev/null >"$logs/aider.log" 2>&1)
  local rc=$?
  if [ $rc = 0 ] && grep -q "return a + b" "$work/project/calc.py"; then record aider "ok (calc.py fixed)";
  elif [ $rc = 0 ]; then record aider "ran (exit 0) but calc.py unchanged: $(tail -n 2 "$logs/aider.log" | tr '\n' ' ' | cut -c1-200)";
  else record aider "FAILED (exit $rc; $(tail -n 2 "$logs/aider.log" | tr '\n' ' ' | cut -c1-200))"; fi
}

run_litellm() {
  local lport
  lport=$(free_port)
  cat >"$work/litellm.yaml" <<EOF
model_list:
  - model_name: via-openai
    litellm_params: {model: "openai/$name", api_base: "$base/v1", api_key: "$key"}
  - model_name: via-vllm
    litellm_params: {model: "hosted_vllm/$name", api_base: "$base/v1", api_key: "$key"}
  - model_name: via-anthropic
    litellm_params: {model: "anthropic/claude-opus-4-8", api_base: "$base", api_key: "$key"}
EOF
  local master="sk-clients-$RANDOM$RANDOM"
  LITELLM_MASTER_KEY="$master" LITELLM_TELEMETRY=False "$cache/litellm-venv/bin/litellm" --config "$work/litellm.yaml" --port "$lport" >"$logs/litellm.log" 2>&1 &
  pids+=("$!")
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$lport/health/liveliness" >/dev/null && break; sleep 1; done
  local out=""
  for m in via-openai via-vllm via-anthropic; do
    local code
    code=$(curl -s -o "$logs/litellm-$m.json" -w '%{http_code}' "http://127.0.0.1:$lport/v1/chat/completions" \
      -H "Authorization: Bearer $master" -H 'content-type: application/json' -d "{\"model\": \"$m\", \"messages\": [{\"role\": \"user\", \"content\": \"Say hi.\"}], \"max_tokens\": 16}")
    out="$out $m=$code"
  done
  local code
  code=$(curl -s -o "$logs/litellm-responses.json" -w '%{http_code}' "http://127.0.0.1:$lport/v1/responses" \
    -H "Authorization: Bearer $master" -H 'content-type: application/json' -d '{"model": "via-openai", "input": "Say hi.", "max_output_tokens": 16}')
  out="$out responses=$code"
  case "$out" in
    *=[!2]*) record litellm "FAILED (HTTP status per route:$out; see $logs/litellm*.json)" ;;
    *) record litellm "ok (HTTP status per route:$out)" ;;
  esac
}

run_fim() {
  local a b c
  a=$(curl -s "$base/v1/completions" -H "Authorization: Bearer $key" -H 'content-type: application/json' \
    -d "{\"model\": \"$name\", \"prompt\": \"def add(a, b):\\n    \", \"suffix\": \"\\n\\nprint(add(2, 3))\\n\", \"max_tokens\": 24, \"temperature\": 0}" \
    | python3 -c 'import json, sys; print(repr(json.load(sys.stdin)["choices"][0]["text"]))')
  b=$(curl -s "$base/infill" -H "Authorization: Bearer $key" -H 'content-type: application/json' \
    -d '{"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "input_extra": [{"filename": "util.py", "text": "X = 1\n"}], "n_predict": 24, "temperature": 0}' \
    | python3 -c 'import json, sys; print(repr(json.load(sys.stdin)["content"]))')
  c=$(curl -s "$base/api/generate" -H "Authorization: Bearer $key" -H 'content-type: application/json' \
    -d "{\"model\": \"$name\", \"prompt\": \"def add(a, b):\\n    \", \"suffix\": \"\\n\", \"stream\": false, \"options\": {\"num_predict\": 24, \"temperature\": 0}}" \
    | python3 -c 'import json, sys; print(repr(json.load(sys.stdin)["response"]))')
  if [ -n "$a" ] && [ -n "$b" ] && [ -n "$c" ]; then record fim "ok (completions suffix: $a; infill: $b; ollama suffix: $c)"; else record fim "FAILED ($a | $b | $c)"; fi
}

for c in $wanted; do
  case "$c" in
    codex) run_codex ;;
    claude) run_claude ;;
    aider) run_aider ;;
    litellm) run_litellm ;;
    fim) run_fim ;;
    *) echo "unknown client $c" ;;
  esac
done
echo
echo "Results (logs in $logs):"
for r in "${results[@]}"; do echo "  $r"; done
