#!/usr/bin/env python3
"""Make the real-model reference fixtures (tests/fixtures/real/) with llama.cpp.

Usage:
    python tools/gen_llama_reference.py --llama-ref BIN --llama-tokenize BIN --lib-dir DIR \
        --model NAME=PATH [--model NAME=PATH ...] [--out DIR] [--n-gen 64] [--topk 10]

  --llama-ref       the llama_ref binary from tools/llama_ref/build.sh
  --llama-tokenize  llama.cpp's llama-tokenize (same build)
  --lib-dir         folder with libllama.so.0 etc. (OUT_DIR/lib of build.sh), put on
                    LD_LIBRARY_PATH for llama-tokenize
  --model           e.g. qwen2.5-coder-0.5b=$HOME/.cache/kapitsa/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  --out             default tests/fixtures/real

Needs python packages numpy, gguf, jinja2. Not run in CI. File formats: tests/fixtures/real/README.md.

What it does, per model:
  * renders the chat prompts with the GGUF's tokenizer.chat_template through jinja2 the way
    transformers' apply_chat_template does (sandboxed env, trim_blocks, lstrip_blocks,
    loopcontrols, tojson; add_generation_prompt=True);
  * tokenizes every prompt text with `llama-tokenize -m GGUF -f FILE --ids --no-bos --no-escape
    --log-disable` (special-token parsing on, which is llama-tokenize's default; no BOS, and no
    escape processing so a literal backslash-n in code stays two characters);
  * runs llama_ref once over all prompts: each prompt is one llama_decode batch with logits for
    every position (top-10 kept per position, plus the full last row), then 64 greedy tokens
    (argmax over the full vocab, EOS not special, KV cache reused; f32 KV cache, no flash attn,
    2 threads), with GGML_CPU_TILED_MM=0: llama.cpp then multiplies K-format weights with its
    stock vec_dot kernels at every batch size, instead of switching to its tiled kernels (a
    different float order) for batches of 8 or more. The prompt and the greedy tokens then go
    through the same kernels, so the fixtures pin one float order (recorded as "llama_env").
"""

import argparse
import hashlib
import json
import re
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# Environment of the llama.cpp runs (see the module docs).
LLAMA_ENV = {"GGML_CPU_TILED_MM": "0"}


def dump_json(obj) -> str:
    """json.dumps(indent=1) with lists of numbers kept on one line (only where json.dumps
    broke them over lines: string values never hold a raw newline, so they are untouched)."""
    s = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(r"\[\s*(-?[0-9][0-9.eE+-]*(?:,\s*-?[0-9][0-9.eE+-]*)*)\s*\]",
                  lambda m: ("[" + re.sub(r",\s*", ", ", m.group(1)) + "]")
                  if "\n" in m.group(0) else m.group(0), s) + "\n"


# ---------------------------------------------------------------------------------------------
# prompts

def long_python_module() -> str:
    """A deterministic ~1,200-token Python file (well over 1,000 tokens)."""
    parts = ['"""Inventory utilities: a small, self-contained module used as a long prompt."""',
             "", "from dataclasses import dataclass, field", "from typing import Dict, List, Optional",
             "", ""]
    items = [("widget", 3, 2.50), ("gadget", 7, 11.25), ("sprocket", 12, 0.75), ("flange", 4, 5.00),
             ("gizmo", 9, 19.99), ("doohickey", 1, 42.00)]
    parts += ["@dataclass", "class Item:", "    name: str", "    quantity: int", "    unit_price: float",
              "    tags: List[str] = field(default_factory=list)", "",
              "    def total(self) -> float:", '        """Value of all units of this item."""',
              "        return self.quantity * self.unit_price", "", ""]
    parts += ["class Inventory:", "    def __init__(self) -> None:",
              "        self._items: Dict[str, Item] = {}", "",
              "    def add(self, item: Item) -> None:",
              "        if item.name in self._items:",
              "            self._items[item.name].quantity += item.quantity",
              "        else:", "            self._items[item.name] = item", "",
              "    def remove(self, name: str, count: int = 1) -> bool:",
              "        item = self._items.get(name)",
              "        if item is None or item.quantity < count:", "            return False",
              "        item.quantity -= count", "        if item.quantity == 0:",
              "            del self._items[name]", "        return True", "",
              "    def find(self, name: str) -> Optional[Item]:", "        return self._items.get(name)", "",
              "    def value(self) -> float:",
              "        return sum(item.total() for item in self._items.values())", "", ""]
    for i, (name, qty, price) in enumerate(items):
        parts += [f"def restock_{name}(inv: Inventory, extra: int = {qty}) -> int:",
                  f'    """Add {qty} more {name}s (or `extra`) and return the new count."""',
                  f'    current = inv.find("{name}")',
                  "    if current is None:",
                  f'        inv.add(Item("{name}", extra, {price:.2f}, tags=["restocked", "batch-{i}"]))',
                  "        return extra",
                  "    current.quantity += extra",
                  "    return current.quantity", "", ""]
    parts += ["def report(inv: Inventory) -> str:", "    lines = []",
              "    for name in sorted(inv._items):", "        item = inv._items[name]",
              '        lines.append(f"{name:<12} {item.quantity:>5} x {item.unit_price:>8.2f} = {item.total():>10.2f}")',
              '    lines.append(f"{\'TOTAL\':<12} {inv.value():>33.2f}")', '    return "\\n".join(lines)', "", "",
              "def cheapest(inv: Inventory) -> Optional[Item]:",
              "    best = None", "    for item in inv._items.values():",
              "        if best is None or item.unit_price < best.unit_price:", "            best = item",
              "    return best", "", "",
              "def most_valuable(inv: Inventory, k: int = 3) -> List[Item]:",
              "    return sorted(inv._items.values(), key=lambda it: it.total(), reverse=True)[:k]", "", "",
              'if __name__ == "__main__":', "    inv = Inventory()"]
    for name, qty, price in items:
        parts.append(f'    inv.add(Item("{name}", {qty}, {price:.2f}))')
    parts += ['    restock_widget(inv)', '    restock_gizmo(inv, 2)', '    inv.remove("flange", 2)',
              "    print(report(inv))", "    print(cheapest(inv))",
              "    for item in most_valuable(inv):", "        print(item.name, item.total())", "",
              "", "def merge(a: Inventory, b: Inventory) -> Inventory:",
              '    """Return a new inventory holding the items of both `a` and `b`."""']
    return "\n".join(parts) + "\n"


RAW_PROMPTS = [
    ("code_python", "def quicksort(arr):\n    \"\"\"Sort a list with the quicksort algorithm.\"\"\"\n    if len(arr) <= 1:\n        return arr\n"),
    ("code_rust", "use std::collections::HashMap;\n\n/// Count how often each word occurs in `text`.\nfn word_counts(text: &str) -> HashMap<String, usize> {\n"),
    ("code_c", "#include <stdio.h>\n#include <stdlib.h>\n\n/* Reverse a singly linked list in place. */\nstruct node { int value; struct node *next; };\n\nstruct node *reverse(struct node *head) {\n"),
    ("code_js", "// Debounce: call fn only after `wait` ms have passed without another call.\nfunction debounce(fn, wait) {\n"),
    ("prose_history", "The history of the printing press begins in the fifteenth century, when"),
    ("prose_recipe", "To bake a simple loaf of bread at home, you will need flour, water, salt and yeast. First,"),
]

CHAT_PROMPTS = [
    ("chat_fizzbuzz", [
        {"role": "system", "content": "You are a helpful coding assistant."},
        {"role": "user", "content": "Write a Python function that prints FizzBuzz for the numbers 1 to 15."}]),
    ("chat_explain_rust", [
        {"role": "system", "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."},
        {"role": "user", "content": "Explain in two sentences what the `?` operator does in Rust."}]),
    ("chat_sql", [
        {"role": "system", "content": "You answer with SQL only, no explanation."},
        {"role": "user", "content": "Table orders(id, customer_id, total, created_at). Give the total spent per customer in 2024, highest first."}]),
    ("chat_bugfix", [
        {"role": "system", "content": "You are a senior C programmer. Be brief."},
        {"role": "user", "content": "What is wrong with this code?\n\n```c\nchar *copy(const char *s) {\n    char *d = malloc(strlen(s));\n    strcpy(d, s);\n    return d;\n}\n```"}]),
    ("chat_multiturn", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 * 13?"},
        {"role": "assistant", "content": "12 * 13 = 156."},
        {"role": "user", "content": "And divided by 4?"}]),
]


def render_chat(template: str, messages) -> str:
    """Render like transformers' apply_chat_template (render_jinja_template)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, tools=None, documents=None, add_generation_prompt=True,
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")


# ---------------------------------------------------------------------------------------------
# GGUF helpers

def gguf_meta(path: Path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))

    def s(key):
        f = r.fields[key]
        return bytes(f.parts[f.data[0]]).decode("utf-8")

    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    return {"chat_template": s("tokenizer.chat_template"), "name": s("general.name"),
            "tokens": tokens}


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def detok(ids, tokens, bd):
    out = bytearray()
    for t in ids:
        s = tokens[t]
        if all(ch in bd for ch in s):
            out += bytes(bd[ch] for ch in s)
        else:  # special / added tokens are stored as plain text
            out += s.encode("utf-8")
    return out.decode("utf-8", errors="replace")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------

def tokenize(tok_bin: Path, env, gguf: Path, text: str, td: Path):
    p = td / "text.txt"
    p.write_bytes(text.encode("utf-8"))
    r = subprocess.run([str(tok_bin), "-m", str(gguf), "-f", str(p), "--ids", "--no-bos",
                        "--no-escape", "--log-disable"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-3000:])
        raise SystemExit("llama-tokenize failed")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("[")][-1]
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-ref", type=Path, required=True)
    ap.add_argument("--llama-tokenize", type=Path, required=True)
    ap.add_argument("--lib-dir", type=Path, required=True)
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "real")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2,
                    help="llama_ref threads; results are bit-identical for 1 and 2, but on a busy "
                         "2-core machine 1 thread is several times faster (no spinning barriers)")
    ap.add_argument("--llama-version", default="", help="recorded in the JSON")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(LLAMA_ENV)
    env["LD_LIBRARY_PATH"] = str(a.lib_dir) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    bd = byte_decoder()

    for spec in a.model:
        name, path = spec.split("=", 1)
        gguf = Path(path).expanduser()
        print(f"== {name}", file=sys.stderr)
        meta = gguf_meta(gguf)
        prompts = []
        for pname, text in RAW_PROMPTS:
            prompts.append(dict(name=pname, chat=False, text=text))
        for pname, msgs in CHAT_PROMPTS:
            prompts.append(dict(name=pname, chat=True, messages=msgs,
                                text=render_chat(meta["chat_template"], msgs)))
        prompts.append(dict(name="long_python", chat=False, text=long_python_module()))

        with tempfile.TemporaryDirectory() as td:
            td = Path(td)
            for p in prompts:
                p["ids"] = tokenize(a.llama_tokenize, env, gguf, p["text"], td)
                p["n_tokens"] = len(p["ids"])
                print(f"  {p['name']}: {p['n_tokens']} tokens", file=sys.stderr)
            (td / "prompts.txt").write_text("".join(" ".join(map(str, p["ids"])) + "\n" for p in prompts))
            r = subprocess.run([str(a.llama_ref), str(gguf), str(td / "prompts.txt"), str(td),
                                "--n-gen", str(a.n_gen), "--topk", str(a.topk), "--kv", "f32",
                                "--threads", str(a.threads)], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                sys.stderr.write(r.stderr[-4000:])
                raise SystemExit("llama_ref failed")
            info = (td / "info.txt").read_text().strip().splitlines()
            n_vocab = int(info[0].split()[1])
            for i, p in enumerate(prompts):
                base = f"{name}_{p['name']}"
                shutil.copy(td / f"last_{i}.bin", a.out / f"{base}_last.bin")
                shutil.copy(td / f"topk_ids_{i}.bin", a.out / f"{base}_top{a.topk}_ids.bin")
                shutil.copy(td / f"topk_vals_{i}.bin", a.out / f"{base}_top{a.topk}_vals.bin")
                p["greedy"] = [int(t) for t in (td / f"gen_{i}.txt").read_text().split()]
                p["greedy_text"] = detok(p["greedy"], meta["tokens"], bd)
                p["last_logits"] = f"{base}_last.bin"
                p["top_ids"] = f"{base}_top{a.topk}_ids.bin"
                p["top_vals"] = f"{base}_top{a.topk}_vals.bin"
                # sanity: the first greedy token is the argmax of the last row / top-1 of last pos
                last = np.fromfile(a.out / p["last_logits"], dtype="<f4")
                tids = np.fromfile(a.out / p["top_ids"], dtype="<i4").reshape(p["n_tokens"], a.topk)
                assert last.shape == (n_vocab,) and int(last.argmax()) == p["greedy"][0] == tids[-1, 0]

        doc = {
            "model": name,
            "gguf_file": gguf.name,
            "gguf_sha256": sha256_file(gguf),
            "gguf_general_name": meta["name"],
            "llama_cpp": a.llama_version,
            "llama_ref_info": info,
            "llama_env": LLAMA_ENV,
            "n_vocab": n_vocab,
            "n_gen": a.n_gen,
            "topk": a.topk,
            "tokenizer": "llama-tokenize --ids --no-bos --no-escape (special tokens parsed)",
            "chat_render": "jinja2 of tokenizer.chat_template, add_generation_prompt=True",
            "prompts": [{k: p[k] for k in ("name", "chat", "messages", "text", "n_tokens", "ids",
                                            "greedy", "greedy_text", "top_ids", "top_vals",
                                            "last_logits") if k in p} for p in prompts],
        }
        (a.out / f"{name}.json").write_text(dump_json(doc))


if __name__ == "__main__":
    main()
