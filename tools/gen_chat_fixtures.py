#!/usr/bin/env python3
"""Render reference chat-template outputs with transformers' apply_chat_template.

Usage:
    python tools/gen_chat_fixtures.py TOKENIZER_DIR [OUT_DIR]

TOKENIZER_DIR holds the tokenizer.json + tokenizer_config.json the templates are attached to
(tests/fixtures/text/qwen2.5-coder-0.5b works; the templates below only use their own special
tokens). Templates are read from OUT_DIR (default tests/fixtures/templates), one
<name>.jinja per template; for each, <name>.cases.json is written with every conversation,
its inputs and the exact string transformers rendered (or the error it raised).

Needs: transformers (5.x), jinja2 >= 3.1.6. Not run in CI.
"""

import json
import os
import sys

from transformers import AutoTokenizer

TEMPLATES = ["qwen2.5", "qwen3", "qwen3.5", "nemotron3-nano"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Don't use for x < 3 & y > 4; returns °C for 東京 or Zürich.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. 'Kraków' or \"São Paulo\""},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit <default: celsius>"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 3},
                    "precision": {"type": "number", "default": 0.5},
                    "include_alerts": {"type": "boolean", "default": False},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query.\nReturns rows as JSON \\ tab\there.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "SELECT ... WHERE a <> 'b'"},
                    "params": {"type": "array", "items": {"type": "string"}, "description": "Bound parameters 🚀"},
                    "options": {
                        "type": "object",
                        "properties": {"timeout_ms": {"type": "integer"}, "dry_run": {"type": "boolean"}},
                    },
                },
                "required": ["query", "params"],
            },
        },
    },
]

SYSTEM = "You are a helpful assistant. Réponds en français si on te parle français. 日本語もOK."

TOOL_CALL_CONVO = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What's the weather in Zürich and in 東京? Also count users <18 & >65."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius", "days": 2, "include_alerts": True, "precision": 0.25}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "run_sql", "arguments": {"query": "SELECT count(*) FROM users WHERE age < 18 OR age > 65", "params": ["a'b", "c\"d"], "options": {"timeout_ms": 500, "dry_run": False}}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"sunny ☀️\"}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "[{\"count\": 42}]"},
    {"role": "assistant", "content": "Zürich: 21.5 °C and sunny. 42 users match."},
    {"role": "user", "content": "Thanks! And Tokyo?"},
]

REASONING_CONVO = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": "391", "reasoning_content": "17*23 = 17*20 + 17*3 = 340 + 51 = 391."},
    {"role": "user", "content": "And 391 / 17?"},
    {"role": "assistant", "content": "<think>\nInverse of the previous step.\n</think>\n\n23"},
    {"role": "user", "content": "Now explain both briefly."},
]

TOOL_CALL_WITH_REASONING = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Need the weather tool for Paris.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "{\"temp\": 18}"},
]


def cases_for(name):
    cases = [
        {"name": "system_user_gen", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello! Who are you?"}], "add_generation_prompt": True},
        {"name": "no_system_no_gen", "messages": [{"role": "user", "content": "  Spaces  and\ttabs\nand newlines  "}], "add_generation_prompt": False},
        {
            "name": "multi_turn_gen",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Write hello world in Rust."},
                {"role": "assistant", "content": "```rust\nfn main() {\n    println!(\"Hello, world!\");\n}\n```"},
                {"role": "user", "content": "Now in C++ <iostream> & templates?"},
            ],
            "add_generation_prompt": True,
        },
        {"name": "multi_turn_nogen", "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Nothing, bye."},
            {"role": "assistant", "content": "Bye 👋"},
        ], "add_generation_prompt": False},
        {"name": "tools_defined_gen", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Kraków?"}], "tools": TOOLS, "add_generation_prompt": True},
        {"name": "tools_no_system_gen", "messages": [{"role": "user", "content": "Weather in Kraków?"}], "tools": TOOLS, "add_generation_prompt": True},
        {"name": "tool_calls_history_gen", "messages": TOOL_CALL_CONVO, "tools": TOOLS, "add_generation_prompt": True},
        {"name": "tool_calls_history_nogen", "messages": TOOL_CALL_CONVO[:-2], "tools": TOOLS, "add_generation_prompt": False},
        {"name": "tool_calls_empty_content_gen", "messages": [dict(m, content="") if m.get("tool_calls") else m for m in TOOL_CALL_CONVO], "tools": TOOLS, "add_generation_prompt": True},
        {"name": "reasoning_history_gen", "messages": REASONING_CONVO, "add_generation_prompt": True},
        {"name": "reasoning_tool_call_gen", "messages": TOOL_CALL_WITH_REASONING, "tools": TOOLS, "add_generation_prompt": True},
        {"name": "thinking_disabled_gen", "messages": [{"role": "user", "content": "Quick: capital of France?"}], "add_generation_prompt": True, "extra": {"enable_thinking": False}},
        {"name": "thinking_enabled_gen", "messages": REASONING_CONVO, "add_generation_prompt": True, "extra": {"enable_thinking": True}},
        {"name": "only_system_error", "messages": [{"role": "system", "content": "sys only"}], "add_generation_prompt": True},
    ]
    if name in ("qwen2.5", "qwen3"):
        # These templates accept JSON-string arguments and print them verbatim.
        cases.append({
            "name": "string_arguments_gen",
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"2+2\"}"}}]},
                {"role": "tool", "content": "4"},
            ],
            "tools": TOOLS,
            "add_generation_prompt": True,
        })
    if name == "nemotron3-nano":
        cases.append({"name": "keep_history_thinking_gen", "messages": REASONING_CONVO, "add_generation_prompt": True, "extra": {"truncate_history_thinking": False}})
        cases.append({"name": "tool_calls_keep_thinking_gen", "messages": TOOL_CALL_WITH_REASONING + [{"role": "assistant", "content": "18 °C."}, {"role": "user", "content": "Thanks"}], "tools": TOOLS, "add_generation_prompt": True, "extra": {"truncate_history_thinking": False, "enable_thinking": False}})
    return cases


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    tok_dir = sys.argv[1]
    out_dir = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "templates")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    special = {k: v for k, v in tok.special_tokens_map.items() if k in ("bos_token", "eos_token")}
    for name in TEMPLATES:
        with open(os.path.join(out_dir, f"{name}.jinja"), encoding="utf-8") as f:
            template = f.read()
        results = []
        for case in cases_for(name):
            kwargs = dict(case.get("extra") or {})
            rec = dict(case)
            try:
                rec["expected"] = tok.apply_chat_template(
                    case["messages"],
                    tools=case.get("tools"),
                    add_generation_prompt=case["add_generation_prompt"],
                    tokenize=False,
                    chat_template=template,
                    **kwargs,
                )
            except Exception as e:  # the Rust side must fail too
                rec["expected_error"] = f"{type(e).__name__}: {e}"
            results.append(rec)
        out = {"template": f"{name}.jinja", "bos_token": special.get("bos_token"), "eos_token": special.get("eos_token"), "cases": results}
        path = os.path.join(out_dir, f"{name}.cases.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, indent=1)
            f.write("\n")
        n_err = sum(1 for r in results if "expected_error" in r)
        print(f"{path}: {len(results)} cases ({n_err} expected errors)")


if __name__ == "__main__":
    main()
