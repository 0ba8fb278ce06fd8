#!/usr/bin/env python3
"""Concurrent decode through `kapitsa serve` (issue #26): S greedy streams at once against the
same requests one at a time, with every concurrent output checked against its solo run, and
optionally llama.cpp's `llama-batched-bench` on the same GGUF file for comparison.

    python3 bench/gpu-streams.py --kapitsa BIN --model FILE.gguf [--device cuda] \\
        [--streams 16] [--prompt-tokens 512] [--gen-tokens 128] [--out DIR] \\
        [--llama-batched-bench PATH --llama-model FILE.gguf] [--strict]

Python 3 standard library only (runs on a bare GPU machine).

Method:
  1. Starts `kapitsa serve -m MODEL --device DEV --port 0 --max-running S --no-prefix-cache`
     (plus --serve-arg ...), reads the address it prints, waits for /health. Without the
     prefix cache each phase computes its prompts itself (the concurrent phase prefills all S
     prompts in flight, as llama-batched-bench does, and the equality check covers the
     prompts' batched prefill too); --prefix-cache keeps the server's default.
  2. Builds S distinct prompts of P token ids each, seeded per stream (ids drawn from the
     lower 80% of the vocabulary, below --max-token-id, away from the special tokens at its
     end; the vocabulary size comes from the server's /detokenize error message). If the
     server refused token-id prompts the script would fall back to seeded random words,
     trimmed to P tokens with /tokenize. Every request is a streaming POST /v1/completions
     with temperature 0, max_tokens N and `ignore_eos` (Kapitsa's extension), so every
     stream generates exactly N tokens.
  3. warm-up (not measured): one request, then S at once, on other prompts (first CUDA
     kernels, graphs and allocations of the batch sizes the phases use).
  4. solo: the S requests one after another. Per request: the arrival time of the first
     streamed token and of the last; single-stream decode rate = (tokens after the first
     chunk) / (t_last - t_first). Reported: the median over the S requests.
  5. concurrent: the same S requests at once, one thread and one HTTP connection per stream
     (connected before a barrier, then sent together).
       steady-state aggregate = tokens all streams received inside the window from the
         moment every stream has had its first token to the moment the first stream
         received its last token, divided by the window's length: S-way decode alone, no
         prefill and no ramp-down in it -- the figure that compares with llama-batched-bench's
         S_TG at B = S;
       whole-run aggregate = all completion tokens / (last stream's last token - the send),
         prefill of the S prompts and the tails included.
     Their ratio to the single-stream rate is reported too (issue #26 asks for >= 8x).
  6. check: every concurrent output equals its solo output (the text and the token count;
     with --logprobs also the tokens' strings). Differences are listed with the position of
     the first one (character, chunk, and token: exact with --logprobs, else a lower bound).
     Random-weight models (`kapitsa synth`) have near-ties in their logits, so a differing
     stream is reported, and only --strict makes it a failure (exit status 1).
  7. llama.cpp (with --llama-batched-bench; --llama-model defaults to --model; run after the
     server stopped, so the GPU is free):
     `llama-batched-bench -m GGUF -ngl 99 -fa 1 -npp P -ntg N -npl 1,S -c S*(P+N)+512`
     (+ --llama-arg ..., env GGML_CUDA_GRAPH_OPT=1 as bench/run-gpu.sh; --llama-env
     overrides); its markdown table (or JSONL) is parsed and S_TG t/s (= B*TG / T_TG) of B = 1
     and B = S reported, with Kapitsa's steady-state aggregate / llama.cpp's B = S S_TG
     (issue #26 asks for >= 3x).

Token counts per chunk: a streamed chunk carries the text of the tokens since the previous one;
a token that ends inside a UTF-8 character sends no chunk of its own, so a chunk can stand for
two tokens or more. Without --logprobs, a stream's chunks share its `usage.completion_tokens`
evenly (the window counts are estimates; the solo rate assumes one token in the first chunk);
--logprobs asks for `logprobs: 0`, whose per-chunk token lists make the counts exact, at the
cost of a log-softmax over the vocabulary per token on the server's engine thread (an f64 exp
per entry, ~150K for Qwen: around a millisecond per token by estimate, not measured, which a
GPU decode step would feel: keep it for checks, not timings).

Output: a markdown block on stdout and in OUTDIR/streams.md, OUTDIR/streams.json with every
number (per-stream times and rates too), the exact commands, OUTDIR/server.log (the server's
stderr) and OUTDIR/llama-batched-bench.log. Exit status 1 on errors (HTTP, a stream that did
not generate N tokens, a panic in the server log, a non-zero server exit), on a mismatch with
--strict, and when llama-batched-bench fails.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "river mountain garden window kitchen memory engine compiler function variable pointer "
    "thread socket buffer network protocol packet kernel matrix vector tensor gradient parser"
).split()

METRICS = (
    "kapitsa_engine_steps_total",
    "kapitsa_generation_tokens_total",
    "kapitsa_prompt_tokens_total",
    "kapitsa_cached_tokens_total",
    "kapitsa_preemptions_total",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(v, f="{:.1f}") -> str:
    return "-" if v is None else f.format(v)


# ---------------------------------------------------------------------------------------------
# Server


class Server:
    """`kapitsa serve` started here: its address, log and process."""

    def __init__(self, a: argparse.Namespace, log_path: str):
        self.a = a
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.host, self.port = "127.0.0.1", 0
        self.cmd: list[str] = []
        self.exit_code: int | None = None
        self.terminated = False  # stop() sent SIGTERM to a running server

    def start(self) -> None:
        a = self.a
        cmd = [a.kapitsa, "serve", "-m", a.model, "--device", a.device, "--host", "127.0.0.1",
               "--port", "0", "--max-running", str(a.streams)]
        if not a.prefix_cache:
            cmd.append("--no-prefix-cache")
        for s in a.serve_arg:
            cmd += shlex.split(s)
        self.cmd = cmd
        log("starting: " + shlex.join(cmd))
        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + a.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Failure(f"kapitsa serve exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            m = re.search(r" on (http://(\S+):(\d+))\s*$", self.log(), re.M)
            if m:
                self.url, self.host, self.port = m.group(1), m.group(2), int(m.group(3))
                break
            time.sleep(0.2)
        else:
            raise Failure(f"kapitsa serve printed no address in {a.start_timeout:g} s:\n{self.log_tail()}")
        while time.monotonic() < deadline:
            try:
                status, _ = self.get("/health")
                if status == 200:
                    log(f"server up at {self.url}")
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise Failure(f"kapitsa serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise Failure(f"/health did not answer 200 within {a.start_timeout:g} s:\n{self.log_tail()}")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.exit_code = -9
                return self.exit_code
        self.exit_code = self.proc.returncode
        return self.exit_code

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, path: str) -> tuple[int, bytes]:
        return self.request("GET", path, timeout=5.0)

    def metrics(self) -> dict[str, float]:
        try:
            status, body = self.get("/metrics")
        except OSError:
            return {}
        out: dict[str, float] = {}
        if status != 200:
            return out
        for line in body.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in METRICS:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    pass
        return out


class Failure(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Prompts


def vocab_size(srv: Server) -> int | None:
    """The tokenizer's vocabulary size, from /detokenize's answer to an id out of range."""
    try:
        status, body = srv.request("POST", "/detokenize", {"tokens": [4294967295]})
    except OSError:
        return None
    m = re.search(r"vocabulary size (\d+)", body.decode(errors="replace"))
    return int(m.group(1)) if m and status == 400 else None


def token_prompts(n: int, seed: int, tag: str, count: int, id_range: tuple[int, int]) -> list[list[int]]:
    """`count` prompts of `n` token ids; prompt i is a function of (seed, tag, i) only."""
    lo, hi = id_range
    return [[random.Random(f"{seed}:{tag}:{i}").randrange(lo, hi) for _ in range(n)] for i in range(count)]


def word_prompts(srv: Server, n: int, seed: int, tag: str, count: int) -> list[str]:
    """`count` texts of about `n` tokens of seeded random words (cut to n tokens by /tokenize)."""
    out = []
    for i in range(count):
        rng = random.Random(f"{seed}:{tag}:{i}")
        words = [rng.choice(WORDS) for _ in range(2 * n)]  # >= 1 token per word
        lo, hi = 1, len(words)
        while lo < hi:  # the most words that tokenise to <= n tokens
            mid = (lo + hi + 1) // 2
            status, body = srv.request("POST", "/tokenize", {"prompt": " ".join(words[:mid])})
            cnt = json.loads(body).get("count") if status == 200 else None
            if cnt is None:
                lo = hi = min(len(words), max(1, int(n / 1.3)))
                break
            if cnt <= n:
                lo = mid
            else:
                hi = mid - 1
        out.append(" ".join(words[:lo]))
    return out


# ---------------------------------------------------------------------------------------------
# Streams


class Stream:
    """One streaming completion: what was sent and every chunk as it arrived."""

    def __init__(self, idx: int, prompt, max_tokens: int):
        self.idx = idx
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.t_send: float | None = None
        # (arrival time, text, exact token count or None, token strings or None)
        self.chunks: list[tuple[float, str, int | None, list[str] | None]] = []
        self.t_finish: float | None = None
        self.finish: str | None = None
        self.usage: dict | None = None
        self.error: str | None = None

    # --- derived
    @property
    def text(self) -> str:
        return "".join(c[1] for c in self.chunks)

    @property
    def n_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("completion_tokens")

    def content(self) -> list[tuple[float, str, int | None, list[str] | None]]:
        """Chunks that carry text or tokens."""
        return [c for c in self.chunks if c[1] or c[2]]

    def exact(self) -> bool:
        return bool(self.chunks) and all(c[2] is not None for c in self.content())

    def chunk_tokens(self) -> list[tuple[float, float]]:
        """(arrival, tokens) per content chunk: exact with logprobs, else usage spread evenly."""
        cs = self.content()
        if not cs:
            return []
        if self.exact():
            return [(c[0], float(c[2])) for c in cs]
        per = (self.n_tokens or len(cs)) / len(cs)
        return [(c[0], per) for c in cs]

    @property
    def t_first(self) -> float | None:
        cs = self.content()
        return cs[0][0] if cs else None

    @property
    def t_last(self) -> float | None:
        cs = self.content()
        return cs[-1][0] if cs else None

    def decode_rate(self) -> float | None:
        """Tokens after the first chunk / (last token - first token)."""
        cs = self.content()
        if len(cs) < 2 or self.n_tokens is None:
            return None
        first = cs[0][2] if self.exact() else 1
        dt = cs[-1][0] - cs[0][0]
        return (self.n_tokens - first) / dt if dt > 0 else None

    def tokens(self) -> list[str] | None:
        if not self.exact():
            return None
        return [t for c in self.content() for t in (c[3] or [])]


def run_stream(srv: Server, model: str, s: Stream, a: argparse.Namespace, barrier: threading.Barrier | None = None) -> None:
    """Send `s` and read its SSE answer (errors end up in s.error, never raised)."""
    body = {
        "model": model,
        "prompt": s.prompt,
        "max_tokens": s.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if a.logprobs:
        body["logprobs"] = 0
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=a.timeout)
    try:
        conn.connect()
        if barrier is not None:
            barrier.wait()
        s.t_send = time.perf_counter()
        deadline = s.t_send + a.timeout
        conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            s.error = f"HTTP {r.status}: {r.read().decode(errors='replace')[:500]}"
            return
        done = False
        while True:
            line = r.readline()
            now = time.perf_counter()
            if not line:
                break
            if now > deadline:
                s.error = f"no complete answer within --timeout {a.timeout:g} s"
                return
            line = line.rstrip(b"\r\n")
            if not line.startswith(b"data:"):
                continue
            d = line[5:].strip()
            if d == b"[DONE]":
                done = True
                break
            c = json.loads(d)
            if "error" in c:
                s.error = "stream error: " + json.dumps(c["error"])[:500]
                return
            if c.get("usage"):
                s.usage = c["usage"]
            for ch in c.get("choices") or []:
                text = ch.get("text") or ""
                lp = ch.get("logprobs")
                toks = lp.get("tokens") if isinstance(lp, dict) else None
                if text or toks:
                    s.chunks.append((now, text, None if toks is None else len(toks), toks))
                if ch.get("finish_reason") is not None:
                    s.finish, s.t_finish = ch["finish_reason"], now
        if not done:
            s.error = "the stream ended without data: [DONE]"
        elif s.usage is None:
            s.error = "no usage chunk"
    except (OSError, http.client.HTTPException, ValueError, threading.BrokenBarrierError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def run_concurrent(srv: Server, model: str, streams: list[Stream], a: argparse.Namespace) -> float:
    """All `streams` at once; returns the time the barrier released them."""
    barrier = threading.Barrier(len(streams) + 1)
    threads = [threading.Thread(target=run_stream, args=(srv, model, s, a, barrier), daemon=True) for s in streams]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=60)
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join(a.timeout + 30)
    for s in streams:
        if s.error is None and s.usage is None and s.finish is None:
            s.error = s.error or "thread did not finish"
    return t0


# ---------------------------------------------------------------------------------------------
# Checks and numbers


def first_difference(a: Stream, b: Stream) -> dict | None:
    """Where b's output first differs from a's: None when the text, the token count and (when
    both have them) the token strings are equal. `token` is exact when both streams have
    per-chunk token counts, else `token_at_least` is a lower bound (chunks before it)."""
    ta, tb = a.text, b.text
    toks_a, toks_b = a.tokens(), b.tokens()
    same = ta == tb and a.n_tokens == b.n_tokens and (toks_a is None or toks_b is None or toks_a == toks_b)
    if same:
        return None
    char = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    ca, cb = a.content(), b.content()
    k = next((i for i, (x, y) in enumerate(zip(ca, cb)) if x[1] != y[1] or x[3] != y[3]), min(len(ca), len(cb)))
    d = {"char": char, "chunk": k, "tokens_a": a.n_tokens, "tokens_b": b.n_tokens}
    if toks_a is not None and toks_b is not None:
        d["token"] = next((i for i, (x, y) in enumerate(zip(toks_a, toks_b)) if x != y), min(len(toks_a), len(toks_b)))
        if ta != tb:  # token strings can hide byte differences ("\ufffd" for partial characters)
            d["token"] = min(d["token"], sum(c[2] for c in ca[:k]))
    else:
        d["token_at_least"] = k
    d["a"] = ta[max(0, char - 20) : char + 40]
    d["b"] = tb[max(0, char - 20) : char + 40]
    return d


def steady_window(streams: list[Stream]) -> dict:
    """Aggregate decode while every stream decodes: from the latest first token to the
    earliest last token."""
    firsts = [s.t_first for s in streams]
    lasts = [s.t_last for s in streams]
    if any(t is None for t in firsts + lasts):
        return {"tokens_per_s": None, "note": "a stream received no token"}
    w0, w1 = max(firsts), min(lasts)
    if w1 <= w0:
        return {
            "tokens_per_s": None,
            "note": f"no moment with all {len(streams)} streams decoding: the first stream finished "
            f"{w0 - w1:.3f} s before the last one got its first token",
        }
    toks = sum(n for s in streams for (t, n) in s.chunk_tokens() if w0 < t <= w1)
    return {"tokens_per_s": toks / (w1 - w0), "window_s": w1 - w0, "tokens": toks, "t0": w0, "t1": w1}


def stream_json(s: Stream, t0: float) -> dict:
    rel = lambda t: None if t is None else round(t - t0, 4)  # noqa: E731
    return {
        "stream": s.idx,
        "prompt_tokens": None if s.usage is None else s.usage.get("prompt_tokens"),
        "cached_tokens": None if s.usage is None else (s.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "completion_tokens": s.n_tokens,
        "chunks": len(s.content()),
        "finish_reason": s.finish,
        "t_send_s": rel(s.t_send),
        "t_first_s": rel(s.t_first),
        "t_last_s": rel(s.t_last),
        "decode_tokens_per_s": None if s.decode_rate() is None else round(s.decode_rate(), 2),
        "error": s.error,
    }


def phase_errors(name: str, streams: list[Stream], n_gen: int) -> list[str]:
    out = []
    for s in streams:
        if s.error:
            out.append(f"{name} stream {s.idx}: {s.error}")
        elif s.n_tokens != n_gen or s.finish != "length":
            out.append(f"{name} stream {s.idx}: {s.n_tokens} tokens, finish {s.finish!r} (expected {n_gen}, 'length')")
    return out


# ---------------------------------------------------------------------------------------------
# llama.cpp


ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([0-9.]+)\s*\|" * 6)
COLS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(out: str) -> list[dict]:
    """Rows of llama-batched-bench's markdown table (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s,
    S_TG t/s, T s, S t/s) or of its JSONL output, with the JSONL field names."""
    rows = []
    for line in out.splitlines():
        line = line.strip()
        m = ROW.match(line)
        if m:
            v = m.groups()
            rows.append({k: (int(x) if i < 4 else float(x)) for i, (k, x) in enumerate(zip(COLS, v))})
        elif line.startswith("{") and '"speed_tg"' in line:
            try:
                j = json.loads(line)
                rows.append({k: j[k] for k in COLS})
            except (ValueError, KeyError):
                pass
    return rows


def run_llama(a: argparse.Namespace, outdir: str) -> tuple[dict, list[str]]:
    ctx = a.streams * (a.prompt_tokens + a.gen_tokens) + 512
    cmd = [a.llama_batched_bench, "-m", a.llama_model, "-ngl", "99", "-fa", "1", "-npp", str(a.prompt_tokens),
           "-ntg", str(a.gen_tokens), "-npl", f"1,{a.streams}", "-c", str(ctx)]
    for s in a.llama_arg:
        cmd += shlex.split(s)
    env_add = {"GGML_CUDA_GRAPH_OPT": "1"}
    for kv in a.llama_env:
        k, _, v = kv.partition("=")
        env_add[k] = v
    env = dict(os.environ, **env_add)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_add.items()) + " " + shlex.join(cmd)
    log("running: " + shown)
    res = {"command": shown, "rows": [], "s_tg_b1": None, "s_tg_bs": None, "exit_code": None}
    path = os.path.join(outdir, "llama-batched-bench.log")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=a.llama_timeout,
                           stdin=subprocess.DEVNULL)
        out, res["exit_code"] = p.stdout.decode(errors="replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        res["exit_code"] = "timeout"
    except OSError as e:
        out, res["exit_code"] = str(e), "not started"
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(path, "w") as f:
        f.write(out)
    res["log"] = path
    rows = parse_batched_bench(out)
    res["rows"] = rows
    for r in rows:
        if r["pp"] == a.prompt_tokens and r["tg"] == a.gen_tokens:
            if r["pl"] == 1:
                res["s_tg_b1"] = r["speed_tg"]
            if r["pl"] == a.streams:
                res["s_tg_bs"] = r["speed_tg"]
    errs = []
    if res["exit_code"] != 0:
        errs.append(f"llama-batched-bench exited with {res['exit_code']} (log: {path}):\n" + "\n".join(out.splitlines()[-15:]))
    elif res["s_tg_b1"] is None or res["s_tg_bs"] is None:
        errs.append(f"llama-batched-bench printed no row for B=1 and B={a.streams} (log: {path})")
    return res, errs


# ---------------------------------------------------------------------------------------------
# Report


def render(rep: dict) -> str:
    k, ll = rep["kapitsa"], rep.get("llama_cpp")
    S, P, N = rep["streams"], rep["prompt_tokens"], rep["gen_tokens"]
    st = k["concurrent"]["steady"]
    lines = [
        f"### {S} concurrent streams: `kapitsa serve --device {rep['device']}`",
        "",
        f"{rep['date']}; model `{os.path.basename(rep['model'].rstrip('/'))}`; device {rep['device']}"
        + (f" ({rep['gpu']})" if rep.get("gpu") else "")
        + f"; {S} streams, prompts of {P} {'token ids' if rep['prompt_kind'] != 'words' else 'tokens of random words'}, "
        f"{N} generated tokens each (greedy, `ignore_eos`); token counts {k['token_counts']}; "
        f"{rep.get('kapitsa_version') or 'kapitsa'}.",
        "",
        "| measure | t/s | x single stream | x llama.cpp |",
        "| --- | ---: | ---: | ---: |",
        f"| Kapitsa single stream (median of {S} solo runs; min / max {fmt(k['solo']['decode_min'])} / "
        f"{fmt(k['solo']['decode_max'])}) | {fmt(k['single_stream_tokens_per_s'])} | 1.00 | "
        f"{fmt(rep.get('ratio_single_vs_llama_b1'), '{:.2f}')} |",
        f"| Kapitsa {S} streams, steady-state aggregate ({fmt(st.get('window_s'), '{:.2f}')} s window, all streams "
        f"decoding) | {fmt(st['tokens_per_s'])} | {fmt(k['ratio_steady_vs_single'], '{:.2f}')} | "
        f"{fmt(rep.get('ratio_steady_vs_llama_bs'), '{:.2f}')} |",
        f"| Kapitsa {S} streams, whole run (all tokens / send to last token, prefill included) | "
        f"{fmt(k['concurrent']['whole_run_tokens_per_s'])} | {fmt(k['ratio_whole_vs_single'], '{:.2f}')} | |",
        f"| Kapitsa {S} streams, per-stream decode (median) | {fmt(k['concurrent']['per_stream_decode_median'])} | | |",
    ]
    if ll:
        lines += [
            f"| llama.cpp B=1 S_TG (llama-batched-bench) | {fmt(ll['s_tg_b1'])} | | 1.00 |",
            f"| llama.cpp B={S} S_TG | {fmt(ll['s_tg_bs'])} | "
            f"{fmt(None if not (ll['s_tg_bs'] and ll['s_tg_b1']) else ll['s_tg_bs'] / ll['s_tg_b1'], '{:.2f}')} "
            f"(of its B=1) | 1.00 |",
        ]
    m = rep["match"]
    lines += [
        "",
        f"Outputs equal to their solo run: **{m['equal']} / {S}**"
        + ("" if not m["differ"] else " (differing: " + ", ".join(
            f"stream {d['stream']} from char {d['char']}, token "
            + (str(d["token"]) if "token" in d else f">= {d['token_at_least']}") for d in m["differ"]) + ")")
        + ".",
        f"Targets (issue #26): steady aggregate >= 8x single stream: "
        f"{rep['targets']['aggregate_8x_single']}; >= 3x llama.cpp's B={S} S_TG: {rep['targets']['aggregate_3x_llama']}; "
        f"every output equal to its solo run: {rep['targets']['outputs_equal']}.",
    ]
    ph = k["concurrent"].get("server_metrics") or {}
    if ph.get("kapitsa_engine_steps_total"):
        lines.append(
            f"Server, concurrent phase: {ph['kapitsa_engine_steps_total']:.0f} engine steps, "
            f"{ph.get('kapitsa_generation_tokens_total', 0):.0f} generated tokens, "
            f"{ph.get('kapitsa_preemptions_total', 0):.0f} preemptions."
        )
    for n in rep["notes"]:
        lines.append(f"Note: {n}")
    lines += ["", "Commands:", "", "```"] + rep["commands"] + ["```"]
    return "\n".join(lines) + "\n"


def gpu_name() -> str | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=20)
        return p.stdout.decode().strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kapitsa", default="target/release/kapitsa", help="the kapitsa binary (default %(default)s)")
    p.add_argument("--model", required=True, help="model file (GGUF) or directory")
    p.add_argument("--device", default="cuda", help="kapitsa serve --device (default %(default)s)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams S, also --max-running (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt P (default 512)")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per stream N (default 128)")
    p.add_argument("--out", help="output folder (default bench/results-gpu/streams-<UTC time>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds the server may take to start")
    p.add_argument("--serve-arg", action="append", default=[], help="more `kapitsa serve` arguments (repeatable)")
    p.add_argument("--prefix-cache", action="store_true", help="keep the server's prefix cache (default: --no-prefix-cache)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests")
    p.add_argument("--logprobs", action="store_true", help="ask for logprobs: exact token counts and tokens, slower server")
    p.add_argument("--seed", type=int, default=1, help="prompt seed (default 1)")
    p.add_argument("--max-token-id", type=int, default=30000, help="prompt token ids stay below this (default 30000)")
    p.add_argument("--strict", action="store_true", help="a concurrent output that differs from its solo run fails (exit 1)")
    p.add_argument("--llama-batched-bench", help="llama.cpp's llama-batched-bench binary")
    p.add_argument("--llama-model", help="GGUF file for llama-batched-bench (default: --model)")
    p.add_argument("--llama-arg", action="append", default=[], help="more llama-batched-bench arguments (repeatable)")
    p.add_argument("--llama-env", action="append", default=[], help="KEY=VALUE for llama-batched-bench "
                   "(repeatable; GGML_CUDA_GRAPH_OPT=1 unless overridden)")
    p.add_argument("--llama-timeout", type=float, default=600.0, help="seconds llama-batched-bench may take")
    a = p.parse_args(argv)
    if a.streams < 1 or a.prompt_tokens < 1 or a.gen_tokens < 2:
        p.error("--streams and --prompt-tokens must be >= 1, --gen-tokens >= 2")
    if a.llama_batched_bench and not a.llama_model:
        a.llama_model = a.model
    outdir = a.out or os.path.join("bench", "results-gpu", "streams-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    os.makedirs(outdir, exist_ok=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    S, P, N = a.streams, a.prompt_tokens, a.gen_tokens
    srv = Server(a, os.path.join(outdir, "server.log"))
    failures: list[str] = []
    notes: list[str] = []
    commands: list[str] = []
    rep: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": a.model,
        "device": a.device,
        "gpu": gpu_name() if a.device.startswith("cuda") else None,
        "streams": S,
        "prompt_tokens": P,
        "gen_tokens": N,
        "seed": a.seed,
        "prompt_kind": None,
    }
    try:
        v = subprocess.run([a.kapitsa, "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30)
        rep["kapitsa_version"] = v.stdout.decode().strip()
    except (OSError, subprocess.TimeoutExpired):
        rep["kapitsa_version"] = None
    solo: list[Stream] = []
    conc: list[Stream] = []
    t_conc0 = 0.0
    interrupted = False
    try:
        srv.start()
        status, body = srv.get("/v1/models")
        model = json.loads(body)["data"][0]["id"] if status == 200 else "default"
        rep["served_name"] = model
        vs = vocab_size(srv)
        rep["vocab_size"] = vs
        hi = min(a.max_token_id, int(vs * 0.8) if vs else a.max_token_id)
        lo = min(1000, hi // 8)
        rep["token_id_range"] = [lo, hi]
        prompts = token_prompts(P, a.seed, "stream", S, (lo, hi))
        warm = token_prompts(P, a.seed, "warmup", S, (lo, hi))
        rep["prompt_kind"] = "token_ids"
        probe = Stream(-1, warm[0], 2)
        run_stream(srv, model, probe, a)
        if probe.error and probe.error.startswith("HTTP 400"):
            notes.append(f"token-id prompts refused ({probe.error[:200]}): prompts are random words")
            rep["prompt_kind"] = "words"
            prompts = word_prompts(srv, P, a.seed, "stream", S)
            warm = word_prompts(srv, P, a.seed, "warmup", S)
        elif probe.error:
            raise Failure(f"probe request failed: {probe.error}")
        # warm-up
        if not a.no_warmup:
            log("warm-up: 1 request, then %d at once" % S)
            w = [Stream(-1, warm[0], min(N, 16))]
            run_stream(srv, model, w[0], a)
            ws = [Stream(-1 - i, warm[i], min(N, 16)) for i in range(S)]
            run_concurrent(srv, model, ws, a)
            for s in w + ws:
                if s.error:
                    raise Failure(f"warm-up request failed: {s.error}")
        # solo
        m0 = srv.metrics()
        for i in range(S):
            s = Stream(i, prompts[i], N)
            run_stream(srv, model, s, a)
            solo.append(s)
            log(f"solo {i + 1}/{S}: {s.n_tokens} tokens, {fmt(s.decode_rate())} t/s" + (f", ERROR {s.error}" if s.error else ""))
        m1 = srv.metrics()
        # concurrent
        conc = [Stream(i, prompts[i], N) for i in range(S)]
        log(f"concurrent: {S} streams")
        t_conc0 = run_concurrent(srv, model, conc, a)
        m2 = srv.metrics()
        log("concurrent done: " + ", ".join(f"{s.n_tokens}" for s in conc) + " tokens")
        rep["server_metrics_solo"] = {k: m1[k] - m0.get(k, 0) for k in m1}
        rep["server_metrics_concurrent"] = {k: m2[k] - m1.get(k, 0) for k in m2}
    except Failure as e:
        failures.append(str(e))
    except KeyboardInterrupt as e:
        failures.append(f"interrupted ({e})")
        interrupted = True
    finally:
        code = srv.stop()
        if srv.cmd:
            commands.append(shlex.join(srv.cmd))
    rep["server_exit_code"] = code
    if srv.terminated and code != 0:
        failures.append(f"the server exited with {code} after SIGTERM (expected 0):\n{srv.log_tail()}")
    if "panicked" in srv.log():
        failures.append("the server printed a panic:\n" + "\n".join(l for l in srv.log().splitlines() if "panick" in l)[:2000])

    # --- numbers
    failures += phase_errors("solo", solo, N) + phase_errors("concurrent", conc, N)
    ok_solo = [s for s in solo if not s.error]
    exact = all(s.exact() for s in solo + conc if not s.error) and bool(solo)
    single = median([s.decode_rate() for s in ok_solo])
    steady = steady_window(conc) if conc and not any(s.error for s in conc) else {"tokens_per_s": None, "note": "concurrent phase incomplete"}
    if steady.get("note"):
        notes.append(steady["note"])
    whole = None
    if conc and not any(s.error for s in conc):
        t_end = max(s.t_last for s in conc)
        whole = sum(s.n_tokens for s in conc) / (t_end - t_conc0)
    differ, equal = [], 0
    for sa, sb in zip(solo, conc):
        if sa.error or sb.error:
            continue
        d = first_difference(sa, sb)
        if d is None:
            equal += 1
        else:
            d["stream"] = sa.idx
            differ.append(d)
    if differ and a.strict:
        failures.append(f"{len(differ)} concurrent output(s) differ from their solo run (--strict)")
    cached = [sj for sj in (stream_json(s, 0) for s in solo + conc) if sj["cached_tokens"]]
    if cached and not a.prefix_cache:
        notes.append(f"{len(cached)} request(s) reported cached prompt tokens although the prefix cache is off")
    if rep.get("prompt_kind") == "token_ids":
        off = [s for s in solo + conc if s.usage and s.usage.get("prompt_tokens") != P]
        if off:
            failures.append(f"stream {off[0].idx}: usage.prompt_tokens {off[0].usage.get('prompt_tokens')}, {P} token ids sent")
    if rep.get("prompt_kind") == "words" and solo and solo[0].usage:
        notes.append(f"word prompts: {statistics.mean(s.usage['prompt_tokens'] for s in solo if s.usage):.0f} tokens on average")
    rep["kapitsa"] = {
        "token_counts": "exact (logprobs)" if exact else "estimated (usage.completion_tokens spread over the chunks)",
        "single_stream_tokens_per_s": single,
        "solo": {
            "decode_median": single,
            "decode_min": min((s.decode_rate() for s in ok_solo if s.decode_rate()), default=None),
            "decode_max": max((s.decode_rate() for s in ok_solo if s.decode_rate()), default=None),
            "ttft_median_s": median([s.t_first - s.t_send for s in ok_solo if s.t_first]),
            "streams": [stream_json(s, s.t_send or 0) for s in solo],
            "server_metrics": rep.pop("server_metrics_solo", None),
        },
        "concurrent": {
            "steady": steady,
            "steady_tokens_per_s": steady["tokens_per_s"],
            "whole_run_tokens_per_s": whole,
            "per_stream_decode_median": median([s.decode_rate() for s in conc if not s.error]),
            "ttft_max_s": max((s.t_first - t_conc0 for s in conc if s.t_first), default=None),
            "streams": [stream_json(s, t_conc0) for s in conc],
            "server_metrics": rep.pop("server_metrics_concurrent", None),
        },
        "ratio_steady_vs_single": ratio(steady["tokens_per_s"], single),
        "ratio_whole_vs_single": ratio(whole, single),
    }
    for key in ("t0", "t1"):
        if key in steady:
            steady[key] = round(steady[key] - t_conc0, 4)
    rep["match"] = {"equal": equal, "compared": equal + len(differ), "differ": differ}

    # --- llama.cpp (after the server stopped: the GPU is free)
    if a.llama_batched_bench and not interrupted:
        try:
            ll, errs = run_llama(a, outdir)
        except KeyboardInterrupt as e:
            ll, errs = None, [f"interrupted ({e})"]
        rep["llama_cpp"] = ll
        failures += errs
        if ll:
            commands.append(ll["command"])
            rep["ratio_single_vs_llama_b1"] = ratio(single, ll["s_tg_b1"])
            rep["ratio_steady_vs_llama_bs"] = ratio(steady["tokens_per_s"], ll["s_tg_bs"])
            rep["ratio_whole_vs_llama_bs"] = ratio(whole, ll["s_tg_bs"])
    r8 = rep["kapitsa"]["ratio_steady_vs_single"]
    r3 = rep.get("ratio_steady_vs_llama_bs")
    rep["targets"] = {
        "aggregate_8x_single": "n/a" if r8 is None else ("yes" if r8 >= 8 else "no") + f" ({r8:.2f}x)",
        "aggregate_3x_llama": "n/a" if r3 is None else ("yes" if r3 >= 3 else "no") + f" ({r3:.2f}x)",
        "outputs_equal": "yes" if (equal == S and not differ) else f"no ({equal}/{S})",
    }
    rep["commands"] = commands
    rep["notes"] = notes
    rep["failures"] = failures
    rep["ok"] = not failures
    rep["server_log"] = srv.log_path
    md = render(rep)
    with open(os.path.join(outdir, "streams.md"), "w") as f:
        f.write(md)
    with open(os.path.join(outdir, "streams.json"), "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    print(md)
    for f_ in failures:
        print(f"FAIL: {f_}")
    if not failures:
        print("PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
