#!/usr/bin/env python3
"""Multi-turn prefix-cache benchmark for `kapitsa serve`: time to first token per turn of a
chat that grows to about 8K tokens, with the prefix cache (cached), without it (uncached), and
with the disk tier after a server restart (restart).

Usage:
    python bench/multiturn.py --kapitsa BIN --model FILE [--turns 8] [--first-words 2300]
        [--turn-words 600] [--max-tokens 16] [--ctx 9216] [--threads 0] [--label NAME]
        [--json OUT]

The first turn is a document of about `--first-words` words (~3K tokens) and a question; each
later turn's prompt is the previous turn's prompt, the previous answer and a new user message
of about `--turn-words` words (deterministic text), so the chat grows to about 8K tokens over
8 turns (the shape of a long-document chat or an agent loop with a large system prompt). Sent
to /v1/completions with streaming;
TTFT is the time from sending the request to the first streamed token. Three passes, each
with a fresh server (port chosen by the server, stopped with SIGINT so it writes its cache):

  uncached  `--no-prefix-cache`: every turn computes its whole prompt.
  cached    prefix cache on, disk tier in a temporary folder.
  restart   a new server on the same disk folder replays the same prompts: every turn
            should find its prefix on disk.

The answer of turn N is re-tokenised as part of turn N+1's prompt, so it may not reproduce
the generated tokens exactly; the prompt of turn N always matches (its end is a checkpoint),
which is also what happens with chat templates that drop earlier reasoning.

Prints a markdown table (TTFT per turn and pass, the uncached/cached ratio) and, with
--json, writes the raw numbers. Needs only the Python standard library.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if "
         "so no what up out who will more about than into them can only other new some could "
         "time these two may then first any my now such like our over man me even most made "
         "after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take "
         "three kernel cache block token expert router layer state batch queue memory thread").split()


def user_text(turn: int, n_words: int) -> str:
    x = 12345 + 7919 * turn
    out = []
    for i in range(n_words):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[(x >> 8) % len(WORDS)])
        if i % 17 == 16:
            out[-1] += "."
    return f"\n\nUser (turn {turn + 1}): " + " ".join(out) + "\n\nAssistant:"


class Server:
    def __init__(self, kapitsa, model, ctx, threads, extra):
        cmd = [kapitsa, "serve", "--model", model, "--port", "0", "-c", str(ctx),
               "--threads", str(threads), "--max-running", "2"] + extra
        self.log = tempfile.TemporaryFile()
        self.p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=self.log, text=True)
        self.url = None
        t0 = time.time()
        for line in self.p.stderr:
            m = re.search(r"on (http://[0-9.:]+)", line)
            if m:
                self.url = m.group(1)
                break
            if time.time() - t0 > 600:
                break
        if not self.url:
            self.p.kill()
            raise SystemExit(f"server did not start: {' '.join(cmd)}")
        self.load_s = time.time() - t0

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        try:
            self.p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.p.kill()


def model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        return json.load(r)["data"][0]["id"]


def ttft(url: str, prompt: str, max_tokens: int):
    """Stream one completion; returns (ttft seconds, text, usage)."""
    body = json.dumps({"model": model_name(url), "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    first = None
    text = ""
    usage = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                if c.get("text"):
                    if first is None:
                        first = time.time() - t0
                    text += c["text"]
    return (first if first is not None else time.time() - t0), text, usage


def run_pass(a, name, extra, prompts=None):
    srv = Server(a.kapitsa, a.model, a.ctx, a.threads, extra)
    rows = []
    made = []
    try:
        prompt = "System: you are a helpful assistant. Answer briefly."
        for t in range(a.turns):
            if prompts is None:
                prompt += user_text(t, a.first_words if t == 0 else a.turn_words)
                p = prompt
            else:
                p = prompts[t]
            s, text, usage = ttft(srv.url, p, a.max_tokens)
            n = usage["prompt_tokens"] if usage else None
            cached = (usage or {}).get("prompt_tokens_details", {}) or {}
            cached = cached.get("cached_tokens")
            rows.append({"turn": t + 1, "prompt_tokens": n, "cached_tokens": cached,
                         "ttft_s": s})
            print(f"{name}: turn {t + 1}: {n} prompt tokens, {cached} cached, "
                  f"TTFT {s:.2f} s", file=sys.stderr, flush=True)
            made.append(p)
            if prompts is None:
                prompt = p + text
    finally:
        srv.stop()
    return rows, made


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kapitsa", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--first-words", type=int, default=2300)
    ap.add_argument("--turn-words", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=9216)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--label", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    label = a.label or os.path.basename(a.model)
    with tempfile.TemporaryDirectory(prefix="kapitsa-multiturn-") as d:
        cached, prompts = run_pass(a, "cached", ["--cache-dir", d])
        uncached, _ = run_pass(a, "uncached", ["--no-prefix-cache"], prompts)
        restart, _ = run_pass(a, "restart", ["--cache-dir", d], prompts)
    print(f"\n### {label}: time to first token per turn (s)\n")
    print("| turn | prompt tokens | uncached | cached (cached tokens) | ratio | after restart "
          "(cached tokens) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for u, c, r in zip(uncached, cached, restart):
        print(f"| {u['turn']} | {u['prompt_tokens']} | {u['ttft_s']:.2f} | "
              f"{c['ttft_s']:.2f} ({c['cached_tokens']}) | {u['ttft_s'] / c['ttft_s']:.1f}x | "
              f"{r['ttft_s']:.2f} ({r['cached_tokens']}) | {u['ttft_s'] / r['ttft_s']:.1f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"label": label, "model": a.model, "uncached": uncached,
                       "cached": cached, "restart": restart}, f, indent=1)


if __name__ == "__main__":
    main()
