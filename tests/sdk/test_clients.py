"""Request shapes of popular clients, replayed against `kapitsa serve` on a real model, streams
checked event by event: Codex CLI (Responses API), Claude Code (Anthropic Messages), Continue
and llama.vscode (fill-in-the-middle), LiteLLM (its openai, hosted_vllm and anthropic
providers) and Open WebUI (Ollama's API).

The bodies follow what those clients send (fields, nesting, headers), trimmed to what matters
and with small `max_tokens` so that each test takes seconds on the 0.5B model. The real
clients themselves run in scripts/clients.sh."""

import json
import uuid

import httpx
import pytest


@pytest.fixture(scope="module")
def http(base_url, api_key):
    with httpx.Client(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {api_key}"}) as c:
        yield c


def sse(text):
    """(event, data) pairs of an SSE body; comment lines skipped, data parsed as JSON."""
    out = []
    for block in text.split("\n\n"):
        ev, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                ev = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            d = "\n".join(data)
            out.append((ev, d if d == "[DONE]" else json.loads(d)))
    return out


# --- Codex CLI -------------------------------------------------------------------------------

CODEX_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}, "description": "The command to execute"},
                "workdir": {"type": "string", "description": "The working directory"},
                "timeout_ms": {"type": "number", "description": "The timeout for the command in milliseconds"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "update_plan",
        "description": "Updates the task plan.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "plan": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"step": {"type": "string"}, "status": {"type": "string"}},
                        "required": ["step", "status"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["plan"],
            "additionalProperties": False,
        },
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Use the `apply_patch` tool to edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"},
    },
    {"type": "web_search"},
]


def codex_body(model, items):
    return {
        "model": model,
        "instructions": "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a user's computer.",
        "input": items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": str(uuid.uuid4()),
        "text": {"verbosity": "medium"},
        "max_output_tokens": 64,
    }


CODEX_HEADERS = {"OpenAI-Beta": "responses=experimental", "originator": "codex_cli_rs", "Accept": "text/event-stream"}


def check_responses_stream(events):
    """The stream is well formed: numbered in order, created first, completed last, every item
    added then done, and the final response's output equal to the items done."""
    names = [e for e, _ in events]
    assert names[0] == "response.created" and names[1] == "response.in_progress", names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    for i, (e, d) in enumerate(events):
        assert d["type"] == e and d["sequence_number"] == i, (i, e, d)
    added = [d["output_index"] for e, d in events if e == "response.output_item.added"]
    done = {d["output_index"]: d["item"] for e, d in events if e == "response.output_item.done"}
    assert added == sorted(done) == list(range(len(added))), names
    final = events[-1][1]["response"]
    assert final["output"] == [done[i] for i in added]
    text = "".join(d["delta"] for e, d in events if e == "response.output_text.delta")
    msgs = [o for o in final["output"] if o["type"] == "message"]
    assert text == "".join(m["content"][0]["text"] for m in msgs)
    assert final["usage"]["input_tokens"] > 0
    return final


def test_codex_cli(http, model):
    items = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/tmp/project</cwd>\n  <approval_policy>never</approval_policy>\n</environment_context>"}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files in this directory."}]},
    ]
    r = http.post("/v1/responses", json=codex_body("gpt-5-codex", items), headers=CODEX_HEADERS)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    final = check_responses_stream(sse(r.text))
    # The next turn carries the call and its output (and any reasoning) back.
    items += [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Run ls."}], "encrypted_content": "opaque"},
        {"type": "function_call", "name": "shell", "arguments": json.dumps({"command": ["ls"]}), "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc\n"},
        {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch", "call_id": "call_2"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done!"},
    ]
    r = http.post("/v1/responses", json=codex_body("gpt-5-codex", items), headers=CODEX_HEADERS)
    assert r.status_code == 200, r.text
    final = check_responses_stream(sse(r.text))
    assert final["store"] is False
    # An unknown item type is a clear 400 in OpenAI's shape.
    r = http.post("/v1/responses", json=codex_body(model, [{"type": "hologram"}]))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[0].type"


# --- Claude Code -----------------------------------------------------------------------------

CLAUDE_TOOLS = [
    {
        "name": "Bash",
        "description": "Executes a given bash command in a persistent shell session.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
                "description": {"type": "string"},
            },
            "required": ["command"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
    },
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}},
            "required": ["file_path"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
        "cache_control": {"type": "ephemeral"},
    },
]

CLAUDE_SYSTEM = (
    "You are Claude Code, Anthropic's official CLI for Claude. You are an interactive CLI tool that helps "
    "users with software engineering tasks. Use the instructions below and the tools available to you to "
    "assist the user. " * 4
)


def claude_body(cch, stream=True):
    return {
        "model": "claude-opus-4-8",
        "max_tokens": 48,
        "stream": stream,
        "temperature": 1,
        "thinking": {"type": "adaptive"},
        "metadata": {"user_id": "user_abc_account__session_123"},
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": CLAUDE_SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following context.\n</system-reminder>"},
                    {"type": "text", "text": "What does `ls -la` do? One sentence.", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "The user is in default permission mode."},
        ],
        "tools": CLAUDE_TOOLS,
    }


CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1.3 (external, cli)",
}


def check_messages_stream(events):
    names = [e for e, _ in events]
    assert names[0] == "message_start", names
    assert names[-1] == "message_stop", names
    assert names[-2] == "message_delta", names
    open_blocks = set()
    for e, d in events:
        assert d["type"] == e
        if e == "content_block_start":
            assert d["index"] not in open_blocks
            open_blocks.add(d["index"])
        elif e == "content_block_delta":
            assert d["index"] in open_blocks
        elif e == "content_block_stop":
            open_blocks.remove(d["index"])
    assert not open_blocks
    return events[0][1]["message"], events[-2][1]


def test_claude_code(http, api_key, base_url):
    # Claude Code probes the root first.
    assert httpx.head(base_url + "/").status_code == 200
    h = dict(CLAUDE_HEADERS, **{"x-api-key": api_key})
    n = http.post("/v1/messages/count_tokens?beta=true", json={k: v for k, v in claude_body("1").items() if k in ("model", "system", "messages", "tools")}, headers=h)
    assert n.status_code == 200, n.text
    assert n.json()["input_tokens"] > 100
    r = http.post("/v1/messages?beta=true", json=claude_body("a1b2c"), headers=h)
    assert r.status_code == 200, r.text
    start, delta = check_messages_stream(sse(r.text))
    assert start["usage"]["input_tokens"] == n.json()["input_tokens"]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    # A new session: another billing hash, same system prompt and tools: served from the prefix
    # cache (the header block is not part of the prompt).
    r = http.post("/v1/messages?beta=true", json=claude_body("ffff9"), headers=h)
    start, _ = check_messages_stream(sse(r.text))
    u = start["usage"]
    assert u["cache_read_input_tokens"] >= 0.8 * u["input_tokens"], u
    # A background call with a Haiku name.
    r = http.post(
        "/v1/messages?beta=true",
        json={"model": "claude-haiku-4-5-20251001", "max_tokens": 16, "messages": [{"role": "user", "content": "Title for: fix the bug"}], "system": [{"type": "text", "text": "Write a 3-word title."}]},
        headers=h,
    )
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    # Bad input: Anthropic's error shape.
    r = http.post("/v1/messages", json={"model": "x", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, headers=h)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


# --- Continue and llama.vscode: fill-in-the-middle ------------------------------------------

PREFIX = "def fibonacci(n):\n    "
SUFFIX = "\n\nprint(fibonacci(10))\n"


def test_continue_autocomplete(http, model):
    body = {
        "model": model,
        "prompt": PREFIX,
        "suffix": SUFFIX,
        "max_tokens": 48,
        "temperature": 0.01,
        "stop": ["\n\n\n", "\n```"],
        "stream": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events = sse(r.text)
    assert events[-1][1] == "[DONE]"
    chunks = [d for _, d in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "return" in text or "fibonacci" in text or "if" in text, text
    # Continue's chat goes through chat completions, streamed.
    r = http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True},
    )
    events = sse(r.text)
    assert events[-1][1] == "[DONE]" and events[0][1]["choices"][0]["delta"]["role"] == "assistant"


def test_llama_vscode_infill(http):
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "utils.py", "text": "def square(x):\n    return x * x\n"}],
        "prompt": "",
        "n_predict": 32,
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
        "response_fields": ["content", "timings/prompt_n", "timings/predicted_n"],
    }
    r = http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    v = r.json()
    assert isinstance(v["content"], str) and v["stop"] is True
    assert v["tokens_evaluated"] > 20
    r = http.post("/infill", json=dict(body, stream=True))
    events = sse(r.text)
    assert events[-1][1]["stop"] is True
    assert all(d["stop"] is False for _, d in events[:-1])


# --- LiteLLM ---------------------------------------------------------------------------------


def test_litellm_providers(http, model, api_key):
    # openai/ and hosted_vllm/ send OpenAI chat completions with the provider's model name.
    for name in ("gpt-4o", "Qwen/Qwen2.5-Coder-0.5B-Instruct"):
        r = http.post(
            "/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert r.status_code == 200, r.text
        events = sse(r.text)
        assert events[-1][1] == "[DONE]"
        assert events[-2][1]["usage"]["completion_tokens"] > 0
    # anthropic/ sends the Messages API.
    r = http.post(
        "/v1/messages",
        json={"model": "claude-3-5-haiku-latest", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]},
        headers={"x-api-key": api_key, "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 200, r.text
    # /v1/responses through LiteLLM's passthrough, not streamed.
    r = http.post("/v1/responses", json={"model": "openai/gpt-4.1", "input": "Say hi.", "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["object"] == "response" and v["output"][0]["type"] == "message"


# --- Open WebUI (Ollama's API) ---------------------------------------------------------------


def test_open_webui(http, model):
    assert http.get("/api/version").json()["version"]
    tags = http.get("/api/tags").json()["models"]
    assert tags[0]["name"] == model
    show = http.post("/api/show", json={"model": model}).json()
    assert show["model_info"]["general.architecture"] == "qwen2"
    assert "insert" in show["capabilities"]
    r = http.post(
        "/api/chat",
        json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "stream": True, "options": {"num_predict": 8}, "keep_alive": "5m"},
    )
    assert r.status_code == 200, r.text
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] > 0
    assert all(x["done"] is False for x in lines[:-1])
    # Title generation: not streamed.
    r = http.post("/api/generate", json={"model": model, "prompt": "Title: hello", "stream": False, "options": {"num_predict": 6}})
    assert r.status_code == 200 and r.json()["done"] is True
    # Ollama's FIM.
    r = http.post("/api/generate", json={"model": model, "prompt": PREFIX, "suffix": SUFFIX, "stream": False, "options": {"num_predict": 16, "temperature": 0}})
    assert r.status_code == 200, r.text
    # Bad input: Ollama's error shape.
    r = http.post("/api/chat", json={"model": model, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
