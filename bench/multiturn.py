#!/usr/bin/env python3
"""Multi-turn prefix-cache benchmark for `kapitsa serve`: time to first token per turn of a
chat that grows to about 8K tokens, with the prefix cache (cached), without it (uncached), and
with the disk tier after a server restart (restart).

Usage:
    python bench/multiturn.py --kapitsa BIN --model FILE [--turns 8] [--first-words 3400]
        [--turn-words 200] [--max-tokens 256] [--ctx 9216] [--threads 0] [--steer-words]
        [--label NAME] [--json OUT]

The chat has the shape of a long-document chat or an agent loop with a large system prompt:
the first turn is a document of about `--first-words` words (~4.5K tokens) and a question;
each later turn's prompt is the previous turn's prompt, the previous answer (`--max-tokens`
generated tokens) and a short new user message of about `--turn-words` words (deterministic
text), so the chat grows by ~500 tokens per turn to about 8K tokens at turn 8. Sent to
/v1/completions with streaming; TTFT is the time from sending the request to the first
streamed token. Three passes, each with a fresh server (port chosen by the server, stopped
with SIGINT so it writes its cache):

  cached    prefix cache on, disk tier in a temporary folder; generates the answers, which
            build the next prompts.
  uncached  `--no-prefix-cache`: replays the cached pass's prompts, every turn computes its
            whole prompt.
  restart   replays the prompts with a new server before every turn, on a second disk
            folder: each turn finds only what the servers before it wrote at shutdown (the
            earlier turns' prompts and answers), so every turn is the first after a restart.

The uncached pass asks for one token per turn (TTFT does not depend on what follows, and
greedy output with and without the cache is identical, which the engine's tests check); the
restart pass generates the answers again so that they reach the disk tier as in a real chat.

The answer of turn N is re-tokenised as part of turn N+1's prompt, so it may not reproduce
the generated tokens exactly: on models with attention only, blocks hit as far as the tokens
match; on hybrid models a hit resumes at a checkpoint, the end of the previous prompt or of
the previous generation (the previous answer is recomputed when its re-tokenisation differs,
as it always is with chat templates that drop earlier reasoning).

--steer-words is for models with random weights (`kapitsa synth` files): their greedy answers
are random tokens, which almost never re-tokenise to themselves once the answer is text in
the next prompt, so every turn would recompute the previous answer -- something a trained
model's answers do not cause (see the 1.5B run in BENCHMARKS.md). The flag adds
`logit_bias` +100 to the single-token words " the", " of", ... (ids from the server's
`/tokenize`), so the answers are runs of whole words, which re-tokenise exactly like a
trained model's text. The computation per token is unchanged; only which token wins.

Prints a markdown table (TTFT per turn and pass, the uncached/cached ratio) and, with
--json, writes the raw numbers. Needs only the Python standard library. To keep the numbers
clean on a shared machine, pin it: `taskset -c 0 python3 bench/multiturn.py --threads 1 ...`.
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


def post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def word_bias(url: str) -> dict:
    """`logit_bias` favouring the words of WORDS that are one token with a leading space."""
    bias = {}
    for w in WORDS:
        ids = post(url, "/tokenize", {"prompt": " " + w, "add_special_tokens": False})["tokens"]
        if len(ids) == 1:
            bias[str(ids[0])] = 100
    if len(bias) < 20:
        raise SystemExit(f"--steer-words: only {len(bias)} single-token words")
    return bias


def ttft(url: str, prompt: str, max_tokens: int, bias=None):
    """Stream one completion; returns (ttft seconds, text, usage)."""
    req_body = {"model": model_name(url), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if bias:
        req_body["logit_bias"] = bias
    body = json.dumps(req_body).encode()
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


def run_pass(a, name, extra, prompts=None, max_tokens=None, restart_each_turn=False):
    """One pass over the turns. Without `prompts` the chat is built from the answers; with
    them the given prompts are replayed. `restart_each_turn` starts a new server (on the same
    cache folder) before every turn and stops it after, so each turn is the first after a
    restart."""
    max_tokens = a.max_tokens if max_tokens is None else max_tokens
    srv = None
    rows = []
    made = []
    try:
        prompt = "System: you are a helpful assistant. Answer briefly."
        for t in range(a.turns):
            if srv is None:
                srv = Server(a.kapitsa, a.model, a.ctx, a.threads, extra)
            if prompts is None:
                prompt += user_text(t, a.first_words if t == 0 else a.turn_words)
                p = prompt
            else:
                p = prompts[t]
            bias = word_bias(srv.url) if a.steer_words and max_tokens > 1 else None
            s, text, usage = ttft(srv.url, p, max_tokens, bias)
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
            if restart_each_turn:
                srv.stop()
                srv = None
    finally:
        if srv is not None:
            srv.stop()
    return rows, made


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kapitsa", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--first-words", type=int, default=3400)
    ap.add_argument("--turn-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=9216)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--steer-words", action="store_true",
                    help="bias the answers to whole words (random-weight models, see above)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    label = a.label or os.path.basename(a.model)
    with tempfile.TemporaryDirectory(prefix="kapitsa-multiturn-") as d, \
            tempfile.TemporaryDirectory(prefix="kapitsa-multiturn-restart-") as d2:
        cached, prompts = run_pass(a, "cached", ["--cache-dir", d])
        uncached, _ = run_pass(a, "uncached", ["--no-prefix-cache"], prompts, max_tokens=1)
        restart, _ = run_pass(a, "restart", ["--cache-dir", d2], prompts,
                              restart_each_turn=True)
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
