#!/usr/bin/env python3
"""Bounded load test of `kapitsa serve`: many concurrent streaming clients for a fixed time,
with checks on every stream, on the server's metrics and on its memory.

    # start a server itself (on a free port; stopped with SIGTERM at the end):
    python bench/load.py --kapitsa target/release/kapitsa --model MODEL.gguf
    # or load a server that is already running (RSS is sampled only with --pid):
    python bench/load.py --url http://127.0.0.1:8080 [--api-key KEY] [--pid PID] [--exclusive]

Phases: `prime` (one request per cache slot at once, each with the longest prompt and the
largest max_tokens of the mix, so every slot touches all the cache it will ever use and the
allocator reaches its working size), `single` (one client, --single-duration seconds) and
`load` (--clients clients, --duration seconds). Each client draws its requests from its own
seeded RNG (client 0 of `load` replays the `single` sequence), so a run repeats exactly
apart from timing. A request is a streaming /v1/chat/completions (or, --messages-fraction of
them, /v1/messages) call with a random-length prompt, a random max_tokens and either
temperature 0 or sampling with a seed; --disconnect-fraction of them are dropped by the client
after a few tokens on purpose. Clients stop starting requests at the deadline; the ones in
flight may finish for --drain seconds, then they are cut (closed, like a disconnect).

Checks (any failure: exit status 1):
  - no errors but the intended ones: client disconnects, streams cut at the end of --drain,
    no request over --request-timeout, and 429 queue-full answers only when
    the server runs with a queue smaller than the number of clients (--allow-queue-full, or a
    --max-queue below --clients for a server started here); each kind is counted;
  - every completed stream is well-formed: OpenAI chunks with one id, the role first, one
    finish_reason, a usage chunk, `data: [DONE]` last; Anthropic message_start, properly
    nested content blocks, message_delta with stop_reason and usage, message_stop last; usage
    consistent (total = prompt + completion, completion <= max_tokens, "length"/"max_tokens"
    exactly at max_tokens, "stop"/"end_turn" below it, no more text chunks than tokens + 1);
  - /metrics during the run: running sequences and slots used never above the slots, cache
    blocks used + cached never above the blocks (when the server exports them), and an engine
    step at least every --stall seconds while requests run or wait (else: a hang);
  - /metrics after the run (waiting up to --settle seconds): kapitsa_requests_running,
    kapitsa_queue_length, kapitsa_slots_used, kapitsa_streams_active and, when exported,
    kapitsa_cache_blocks_used all back to 0;
  - with --exclusive (implied for a server started here: nobody else uses it): the engine
    finished + cancelled exactly the requests it accepted, the 200 answers per endpoint match,
    and the generated-token counter lies between the tokens of the completed streams and that
    plus the max_tokens of the dropped ones;
  - server RSS (VmRSS, sampled every second): after warm-up it may grow by at most
    --rss-growth-mib (see RSS_HELP);
  - a server started here must not print a panic, must still be alive at the end and must
    exit 0 on SIGTERM.

Reports aggregate generation tokens/s of `load` against `single` (the server's
kapitsa_generation_tokens_total over each phase's fixed window, the load phase's first
--warmup seconds left out), per wall second and per second of server CPU time, as a markdown
table row and as JSON (--json FILE also writes it to a file). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

RSS_HELP = (
    "largest allowed RSS growth after warm-up, MiB (default 64). The KV block pool is allocated "
    "when the server starts (pages count once written); the prime phase runs the largest batch "
    "of the longest sequences of the mix, so what is left is the allocator settling (per-thread "
    "arenas, batch buffers sized by the largest step) - -2 to +0.1 MiB in the runs so far. "
    "64 MiB is far above that noise and far below what a per-request leak costs over a run of "
    "hundreds of requests: one logits row (vocab x 4 bytes, 0.6 MiB for Qwen2.5) kept per "
    "request, or any per-token leak, crosses it."
)

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river mountain garden window kitchen memory engine compiler function variable "
    "pointer thread socket buffer network protocol packet kernel matrix vector tensor "
    "gradient optimizer parser lexer token grammar syntax semantic runtime scheduler "
    "allocator database transaction index query cursor schema migration server client cache"
).split()

SYSTEM = "You are a helpful assistant. Keep answers short."

QUEUE_FULL = "queue_full_429"


def parse_range(s: str) -> tuple[int, int]:
    a, _, b = s.partition("-")
    lo, hi = int(a), int(b or a)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"bad range {s!r} (want MIN-MAX, 1 <= MIN <= MAX)")
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class Spec:
    """One request of the mix."""

    api: str  # "chat" or "messages"
    words: list[str]
    max_tokens: int
    temperature: float
    top_p: float | None
    seed: int | None
    disconnect_after: int | None  # drop the stream after this many text chunks
    ignore_eos: bool = False

    def user_text(self) -> str:
        return "Here is a list of words: " + " ".join(self.words) + ". Write a short story that uses some of them."


def draw(rng: random.Random, a: argparse.Namespace) -> Spec:
    """The next request of a client (all randomness from `rng`)."""
    api = "messages" if rng.random() < a.messages_fraction else "chat"
    n_words = rng.randint(*a.prompt_words)
    words = [rng.choice(WORDS) for _ in range(n_words)]
    max_tokens = rng.randint(*a.max_tokens)
    if rng.random() < a.greedy_fraction:
        temperature, top_p, seed = 0.0, None, None
    else:
        temperature = rng.choice([0.6, 0.8, 1.0])
        top_p = 0.95
        seed = rng.randrange(1 << 31)
    disconnect = None
    if rng.random() < a.disconnect_fraction:
        disconnect = rng.randint(1, max(1, max_tokens // 2))
    return Spec(api, words, max_tokens, temperature, top_p, seed, disconnect)


def body_of(spec: Spec, model: str) -> tuple[str, dict]:
    if spec.api == "chat":
        b = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": spec.user_text()}],
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.top_p is not None:
            b["top_p"] = spec.top_p
        if spec.seed is not None:
            b["seed"] = spec.seed
        if spec.ignore_eos:
            b["ignore_eos"] = True
        return "/v1/chat/completions", b
    b = {
        "model": model,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": spec.user_text()}],
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
    }
    if spec.top_p is not None:
        b["top_p"] = spec.top_p
    return "/v1/messages", b


@dataclass
class Result:
    """What happened to one request."""

    phase: str
    client: int
    seq: int
    spec: Spec
    kind: str = "ok"  # ok | disconnect | cut_at_end | http_NNN | queue_full_429 | transport:X | stream_error | malformed | timeout
    detail: str = ""
    status: int | None = None  # HTTP status, once the answer's head arrived
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    text: str = ""
    chunks: int = 0  # text chunks received
    t_last: float | None = None  # arrival of the last text chunk
    max_gap: float = 0.0  # longest wait between two text chunks (a stalled stream)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def text_chunk(self, piece: str, text: list[str]) -> None:
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = now
        else:
            self.max_gap = max(self.max_gap, now - self.t_last)
        self.t_last = now
        text.append(piece)
        self.chunks += 1


class Malformed(Exception):
    pass


async def sse_events(r: httpx.Response):
    """(event name, data) of an SSE response; comment lines are skipped."""
    ev, data = None, []
    async for line in r.aiter_lines():
        if line == "":
            if data:
                yield ev, "\n".join(data)
            ev, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            ev = line[6:].strip()
        elif line.startswith("data:"):
            d = line[5:]
            data.append(d[1:] if d.startswith(" ") else d)
    if data:
        yield ev, "\n".join(data)


def check_usage_vs_finish(res: Result, n_ctx: int | None, length_name: str, stop_name: str) -> None:
    spec = res.spec
    c = res.completion_tokens
    if c is None or res.prompt_tokens is None:
        raise Malformed("no usage")
    if c < 0 or c > spec.max_tokens:
        raise Malformed(f"completion tokens {c} outside [0, max_tokens={spec.max_tokens}]")
    context_bound = n_ctx is not None and res.prompt_tokens + spec.max_tokens >= n_ctx
    if res.finish == length_name and c != spec.max_tokens and not context_bound:
        raise Malformed(f"finish {length_name!r} after {c} tokens, max_tokens {spec.max_tokens}")
    if res.finish == stop_name and c >= spec.max_tokens:
        raise Malformed(f"finish {stop_name!r} with {c} tokens = max_tokens {spec.max_tokens}")
    if spec.ignore_eos and res.finish != length_name:
        raise Malformed(f"ignore_eos request ended with {res.finish!r}")
    if res.chunks > c + 1:
        raise Malformed(f"{res.chunks} text chunks for {c} tokens")


async def read_chat(r: httpx.Response, res: Result, model: str, n_ctx: int | None) -> None:
    spec = res.spec
    cid, role_seen, done, usage = None, False, False, None
    text = []
    async for _, data in sse_events(r):
        if done:
            raise Malformed(f"data after [DONE]: {data[:200]}")
        if data == "[DONE]":
            done = True
            continue
        try:
            c = json.loads(data)
        except ValueError:
            raise Malformed(f"chunk is not JSON: {data[:200]}") from None
        if "error" in c:
            res.kind, res.detail = "stream_error", json.dumps(c["error"])[:300]
            return
        if c.get("object") != "chat.completion.chunk" or c.get("model") != model:
            raise Malformed(f"bad chunk header: {data[:200]}")
        cid = cid or c.get("id")
        if c.get("id") != cid or not str(cid).startswith("chatcmpl-"):
            raise Malformed(f"chunk id {c.get('id')!r} != {cid!r}")
        if c.get("usage"):
            if c.get("choices"):
                raise Malformed("usage chunk with choices")
            if res.finish is None:
                raise Malformed("usage before finish_reason")
            usage = c["usage"]
            continue
        choices = c.get("choices") or []
        if len(choices) != 1 or choices[0].get("index") != 0:
            raise Malformed(f"chunk choices: {data[:200]}")
        ch = choices[0]
        delta = ch.get("delta") or {}
        if not role_seen:
            if delta.get("role") != "assistant":
                raise Malformed(f"first chunk has no role: {data[:200]}")
            role_seen = True
        if res.finish is not None:
            raise Malformed(f"chunk after finish_reason: {data[:200]}")
        piece = delta.get("content")
        if piece:
            res.text_chunk(piece, text)
            if spec.disconnect_after is not None and res.chunks >= spec.disconnect_after:
                res.kind = "disconnect"
                res.text = "".join(text)
                return  # leaving the `stream` context closes the connection mid-stream
        if ch.get("finish_reason") is not None:
            res.finish = ch["finish_reason"]
            if res.finish not in ("stop", "length"):
                raise Malformed(f"finish_reason {res.finish!r}")
    res.text = "".join(text)
    if not done:
        raise Malformed("stream ended without data: [DONE]")
    if res.finish is None:
        raise Malformed("no finish_reason")
    if usage is None:
        raise Malformed("no usage chunk (include_usage was asked)")
    res.prompt_tokens, res.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if usage.get("total_tokens") != (res.prompt_tokens or 0) + (res.completion_tokens or 0):
        raise Malformed(f"usage does not add up: {usage}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if not 0 <= cached <= res.prompt_tokens:
        raise Malformed(f"cached_tokens {cached} outside [0, prompt_tokens]: {usage}")
    check_usage_vs_finish(res, n_ctx, "length", "stop")


async def read_messages(r: httpx.Response, res: Result, model: str, n_ctx: int | None) -> None:
    spec = res.spec
    names: list[str] = []
    open_index, next_index, stopped = None, 0, False
    input_start, delta_usage = None, None
    text = []
    async for ev, data in sse_events(r):
        if stopped:
            raise Malformed(f"event after message_stop: {ev} {data[:200]}")
        try:
            d = json.loads(data)
        except ValueError:
            raise Malformed(f"event data is not JSON: {data[:200]}") from None
        if ev == "error" or d.get("type") == "error":
            res.kind, res.detail = "stream_error", json.dumps(d.get("error"))[:300]
            return
        if d.get("type") != ev:
            raise Malformed(f"event {ev!r} carries type {d.get('type')!r}")
        names.append(ev)
        if len(names) == 1 and ev != "message_start":
            raise Malformed(f"first event {ev!r}")
        if ev == "message_start":
            if len(names) != 1:
                raise Malformed("second message_start")
            m = d["message"]
            if m.get("model") != model or m.get("role") != "assistant" or not str(m.get("id", "")).startswith("msg_"):
                raise Malformed(f"bad message_start: {data[:200]}")
            input_start = m["usage"]["input_tokens"]
        elif ev == "ping":
            pass
        elif ev == "content_block_start":
            if open_index is not None or d.get("index") != next_index or delta_usage is not None:
                raise Malformed(f"content_block_start out of order: {data[:200]}")
            open_index = d["index"]
        elif ev == "content_block_delta":
            if d.get("index") != open_index:
                raise Malformed(f"delta for block {d.get('index')} while {open_index} is open")
            dd = d.get("delta") or {}
            if dd.get("type") == "text_delta":
                res.text_chunk(dd.get("text", ""), text)
                if spec.disconnect_after is not None and res.chunks >= spec.disconnect_after:
                    res.kind = "disconnect"
                    res.text = "".join(text)
                    return
        elif ev == "content_block_stop":
            if d.get("index") != open_index:
                raise Malformed(f"content_block_stop for {d.get('index')} while {open_index} is open")
            open_index, next_index = None, next_index + 1
        elif ev == "message_delta":
            if open_index is not None or delta_usage is not None:
                raise Malformed("message_delta with a block open or twice")
            res.finish = (d.get("delta") or {}).get("stop_reason")
            if res.finish not in ("end_turn", "max_tokens"):
                raise Malformed(f"stop_reason {res.finish!r}")
            delta_usage = d.get("usage") or {}
        elif ev == "message_stop":
            if delta_usage is None:
                raise Malformed("message_stop before message_delta")
            stopped = True
        else:
            raise Malformed(f"unknown event {ev!r}")
    res.text = "".join(text)
    if not stopped:
        raise Malformed(f"stream ended without message_stop (events: {names[-5:]})")
    res.prompt_tokens = input_start
    res.completion_tokens = delta_usage.get("output_tokens")
    if delta_usage.get("input_tokens", input_start) != input_start:
        raise Malformed(f"input_tokens {input_start} at the start, {delta_usage.get('input_tokens')} at the end")
    check_usage_vs_finish(res, n_ctx, "max_tokens", "end_turn")


class Target:
    """The server under test: its address, key and (optionally) process."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.url = a.url
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = a.pid
        self.log_path: str | None = None
        self.exit_code: int | None = None
        self.model = a.model_name
        self.n_ctx: int | None = None

    def headers(self, api: str) -> dict:
        h = {}
        if self.a.api_key:
            if api == "messages":
                h["x-api-key"] = self.a.api_key
            else:
                h["Authorization"] = f"Bearer {self.a.api_key}"
        if api == "messages":
            h["anthropic-version"] = "2023-06-01"
        return h

    def start(self) -> None:
        a = self.a
        cmd = [a.kapitsa, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", "0"]
        for flag, v in (
            ("--max-running", a.max_running),
            ("--max-queue", a.max_queue),
            ("--max-batch-tokens", a.max_batch_tokens),
            ("--ctx-size", a.ctx_size),
            ("--threads", a.threads),
            ("--api-key", a.api_key),
        ):
            if v is not None:
                cmd += [flag, str(v)]
        for s in a.server_arg:
            cmd += shlex.split(s)
        fd, self.log_path = tempfile.mkstemp(prefix="kapitsa-load-", suffix=".log")
        log = os.fdopen(fd, "w")
        print("starting: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.pid = self.proc.pid
        deadline = time.monotonic() + a.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"kapitsa serve exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            m = re.search(r"on (http://\S+)", self.log())
            if m:
                self.url = m.group(1)
                return
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"kapitsa serve did not start in {a.start_timeout} s:\n{self.log_tail()}")

    def log(self) -> str:
        path = self.log_path or self.a.server_log
        if not path:
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
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


async def one_request(client: httpx.AsyncClient, t: Target, res: Result, timeout: float) -> Result:
    path, body = body_of(res.spec, t.model)
    res.t_start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", t.url + path, json=body, headers=t.headers(res.spec.api)) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    res.kind = QUEUE_FULL if r.status_code == 429 else f"http_{r.status_code}"
                    res.detail = raw.decode(errors="replace")[:300]
                elif not r.headers.get("content-type", "").startswith("text/event-stream"):
                    raise Malformed(f"content-type {r.headers.get('content-type')!r}")
                elif res.spec.api == "chat":
                    await read_chat(r, res, t.model, t.n_ctx)
                else:
                    await read_messages(r, res, t.model, t.n_ctx)
    except Malformed as e:
        res.kind, res.detail = "malformed", str(e)
    except TimeoutError:
        res.kind, res.detail = "timeout", f"no complete answer within {timeout} s (a hang?)"
    except httpx.HTTPError as e:
        res.kind, res.detail = f"transport:{type(e).__name__}", str(e)[:300]
    except asyncio.CancelledError:
        # The phase's drain time ran out: the connection is closed like a disconnect.
        res.kind, res.detail = "cut_at_end", "still running when --drain ran out"
        res.t_end = time.monotonic()
        raise
    res.t_end = time.monotonic()
    return res


# ---------------------------------------------------------------------------------------------
# Metrics and process sampling


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, v = line.rpartition(" ")
        try:
            out[name] = float(v)
        except ValueError:
            pass
    return out


GAUGES = [
    "kapitsa_requests_running",
    "kapitsa_queue_length",
    "kapitsa_slots_used",
    "kapitsa_streams_active",
    "kapitsa_cache_blocks_used",
]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


@dataclass
class Sampler:
    """Polls /metrics, RSS and the load average every second."""

    client: httpx.AsyncClient
    target: Target
    rss: list[tuple[float, int]] = field(default_factory=list)
    load: list[tuple[float, float]] = field(default_factory=list)
    metrics: list[tuple[float, dict]] = field(default_factory=list)
    peaks: dict = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    metric_failures: int = 0
    stall_s: float = 120.0
    longest_stall: float = 0.0
    _steps: float | None = None
    _steps_since: float = 0.0

    async def metrics_now(self) -> dict[str, float]:
        r = await self.client.get(self.target.url + "/metrics", timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)

    def sample_proc(self) -> None:
        now = time.monotonic()
        self.load.append((now, loadavg()))
        if self.target.pid is not None:
            k = rss_kib(self.target.pid)
            if k is not None:
                self.rss.append((now, k))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample_proc()
            try:
                m = await self.metrics_now()
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                self.metric_failures += 1
                self.violations.append(f"GET /metrics failed during the run: {type(e).__name__}: {e}")
            else:
                now = time.monotonic()
                self.metrics.append((now, m))
                # A hang: work waiting, yet no engine step for --stall seconds.
                steps = m.get("kapitsa_engine_steps_total")
                busy = m.get("kapitsa_requests_running", 0) + m.get("kapitsa_queue_length", 0) > 0
                if steps != self._steps or not busy:
                    self._steps, self._steps_since = steps, now
                else:
                    self.longest_stall = max(self.longest_stall, now - self._steps_since)
                    if now - self._steps_since > self.stall_s:
                        self.violations.append(
                            f"no engine step for more than {self.stall_s:g} s with {m.get('kapitsa_requests_running', 0):g} "
                            f"running and {m.get('kapitsa_queue_length', 0):g} queued (engine hang?)"
                        )
                for g in GAUGES + ["kapitsa_cache_blocks_cached", "kapitsa_cache_blocks_total", "kapitsa_slots_total"]:
                    if g in m:
                        self.peaks[g] = max(self.peaks.get(g, 0), m[g])
                slots = m.get("kapitsa_slots_total")
                for g in ("kapitsa_requests_running", "kapitsa_slots_used"):
                    if slots is not None and m.get(g, 0) > slots:
                        self.violations.append(f"{g} = {m[g]:g} > kapitsa_slots_total = {slots:g}")
                bt = m.get("kapitsa_cache_blocks_total")
                held = m.get("kapitsa_cache_blocks_used", 0) + m.get("kapitsa_cache_blocks_cached", 0)
                if bt is not None and held > bt:
                    self.violations.append(
                        f"kapitsa_cache_blocks_used + _cached = {held:g} > kapitsa_cache_blocks_total = {bt:g}"
                    )
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


# ---------------------------------------------------------------------------------------------
# Phases


@dataclass
class Phase:
    name: str
    clients: int
    t0: float = 0.0
    t_deadline: float = 0.0
    t_end: float = 0.0
    gen_start: float | None = None  # kapitsa_generation_tokens_total at t0
    gen_deadline: float | None = None  # ... at the deadline
    cpu_start: float | None = None
    cpu_deadline: float | None = None
    wall: float = 0.0  # from the first request to the last answer
    results: list[Result] = field(default_factory=list)


async def client_loop(http, t: Target, ph: Phase, cid: int, a, stop_at: float, out: list[Result]) -> None:
    rng = random.Random(f"{a.seed}:{cid}")
    seq = 0
    while time.monotonic() < stop_at:
        spec = draw(rng, a)
        res = Result(ph.name, cid, seq, spec)
        try:
            await one_request(http, t, res, a.request_timeout)
        finally:
            out.append(res)
        seq += 1
        if res.kind == QUEUE_FULL:
            await asyncio.sleep(0.05 + rng.random() * 0.2)  # back off, as a client would
        elif not res.ok and res.kind != "disconnect":
            await asyncio.sleep(0.2)  # do not spin on a failing server


async def counter(s: Sampler, name: str) -> float | None:
    try:
        return (await s.metrics_now()).get(name)
    except httpx.HTTPError:
        return None


async def timed_phase(http, s: Sampler, t: Target, a, name: str, clients: int, seconds: float, skip: float = 0.0) -> Phase:
    ph = Phase(name, clients)
    t_start = time.monotonic()
    ph.t_deadline = t_start + seconds
    tasks = [asyncio.create_task(client_loop(http, t, ph, c, a, ph.t_deadline, ph.results)) for c in range(clients)]
    # The throughput window leaves out the first `skip` seconds (the burst of admissions and
    # prefills when all clients start at once).
    await asyncio.sleep(skip)
    ph.gen_start = await counter(s, "kapitsa_generation_tokens_total")
    ph.cpu_start = cpu_seconds(t.pid)
    ph.t0 = time.monotonic()
    await asyncio.sleep(max(0.0, ph.t_deadline - time.monotonic()))
    ph.gen_deadline = await counter(s, "kapitsa_generation_tokens_total")
    ph.cpu_deadline = cpu_seconds(t.pid)
    # Requests in flight at the deadline may finish for --drain seconds; then they are cut.
    _, pending = await asyncio.wait(tasks, timeout=a.drain)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ph.t_end = time.monotonic()
    ph.wall = ph.t_end - t_start
    return ph


async def prime_phase(http, s: Sampler, t: Target, a, slots: int) -> Phase:
    ph = Phase("prime", slots)
    longest = sorted(WORDS, key=len)[-8:]
    rng = random.Random(f"{a.seed}:prime")
    ph.t0 = time.monotonic()
    specs = [
        Spec("chat", [rng.choice(longest) for _ in range(a.prompt_words[1])], a.max_tokens[1], 0.0, None, None, None, True)
        for _ in range(slots)
    ]
    ph.results = list(
        await asyncio.gather(*(one_request(http, t, Result("prime", i, 0, sp), a.request_timeout) for i, sp in enumerate(specs)))
    )
    ph.t_end = ph.t_deadline = time.monotonic()
    ph.wall = ph.t_end - ph.t0
    return ph


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def phase_stats(ph: Phase) -> dict:
    done = [r for r in ph.results if r.ok]
    window = ph.t_deadline - ph.t0
    gen = None
    if ph.gen_start is not None and ph.gen_deadline is not None and window > 0:
        gen = (ph.gen_deadline - ph.gen_start) / window
    wall = ph.wall
    completed_tokens = sum(r.completion_tokens or 0 for r in done)
    ttft = [r.t_first - r.t_start for r in ph.results if r.t_first is not None]
    gaps = [r.max_gap for r in ph.results if r.chunks > 1]
    per_stream = [
        (r.completion_tokens - 1) / (r.t_end - r.t_first)
        for r in done
        if r.t_first is not None and (r.completion_tokens or 0) > 4 and r.t_end > r.t_first
    ]
    cpu = per_cpu = None
    if ph.cpu_start is not None and ph.cpu_deadline is not None and window > 0:
        cpu = (ph.cpu_deadline - ph.cpu_start) / window
        if gen is not None and cpu > 0:
            per_cpu = gen / cpu
    return {
        "clients": ph.clients,
        "window_s": round(window, 2),
        "wall_s": round(wall, 2),
        "requests": len(ph.results),
        "completed": len(done),
        "kinds": dict(Counter(r.kind for r in ph.results)),
        "gen_tokens_per_s": None if gen is None else round(gen, 2),
        "completed_tokens": completed_tokens,
        "completed_tokens_per_s_wall": round(completed_tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_s": None if not ttft else round(pct(ttft, 0.5), 3),
        "ttft_p95_s": None if not ttft else round(pct(ttft, 0.95), 3),
        # The longest pause inside a stream (p50 / p95 over streams): a long prefill step
        # stalls every stream decoding beside it.
        "stream_max_gap_p50_s": None if not gaps else round(pct(gaps, 0.5), 3),
        "stream_max_gap_p95_s": None if not gaps else round(pct(gaps, 0.95), 3),
        "stream_tokens_per_s_median": None if not per_stream else round(statistics.median(per_stream), 2),
        "server_cpu_cores": None if cpu is None else round(cpu, 2),
        # Tokens per second of server CPU time: on a shared machine, where the server gets
        # only part of the cores, this compares phases better than tokens per wall second.
        "gen_tokens_per_cpu_s": None if per_cpu is None else round(per_cpu, 2),
    }


# ---------------------------------------------------------------------------------------------
# Main


async def run(a: argparse.Namespace, t: Target) -> tuple[dict, list[str]]:
    failures: list[str] = []
    notes: list[str] = []
    limits = httpx.Limits(max_connections=a.clients + 16, max_keepalive_connections=a.clients + 16)
    timeout = httpx.Timeout(a.request_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http, httpx.AsyncClient(
        timeout=10.0, trust_env=False
    ) as mon:
        s = Sampler(mon, t, stall_s=a.stall)
        # Wait for the server to answer.
        deadline = time.monotonic() + a.start_timeout
        while True:
            try:
                if (await mon.get(t.url + "/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not t.alive():
                raise SystemExit(f"{t.url}/health did not answer 200\n{t.log_tail()}")
            await asyncio.sleep(0.5)
        h = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        models = (await mon.get(t.url + "/v1/models", headers=h)).json()["data"]
        t.model = t.model or models[0]["id"]
        t.n_ctx = models[0].get("max_model_len")
        before = await s.metrics_now()
        slots = int(before.get("kapitsa_slots_total", 1))
        has_blocks = "kapitsa_cache_blocks_used" in before
        load_start = loadavg()
        rusage0 = resource.getrusage(resource.RUSAGE_SELF)
        stop = asyncio.Event()
        sampler = asyncio.create_task(s.run(stop))
        phases: list[Phase] = []
        if not a.no_prime:
            print(f"prime: {slots} requests at once (one per slot)", file=sys.stderr)
            phases.append(await prime_phase(http, s, t, a, slots))
        if a.single_duration > 0:
            print(f"single: 1 client for {a.single_duration:g} s", file=sys.stderr)
            phases.append(await timed_phase(http, s, t, a, "single", 1, a.single_duration))
        print(f"load: {a.clients} clients for {a.duration:g} s", file=sys.stderr)
        t_load = time.monotonic()
        warm_until = t_load + a.warmup
        phases.append(await timed_phase(http, s, t, a, "load", a.clients, a.duration, skip=min(a.warmup, a.duration / 2)))
        # Settle: the gauges go back to 0.
        settle_deadline = time.monotonic() + a.settle
        after = await s.metrics_now()
        while time.monotonic() < settle_deadline and any(after.get(g, 0) != 0 for g in GAUGES):
            await asyncio.sleep(0.25)
            after = await s.metrics_now()
        settle_s = a.settle - max(0.0, settle_deadline - time.monotonic())
        s.sample_proc()
        stop.set()
        await sampler
        rusage1 = resource.getrusage(resource.RUSAGE_SELF)
        load_end = loadavg()

    results = [r for ph in phases for r in ph.results]
    by_phase = {ph.name: ph for ph in phases}
    kinds = Counter(r.kind for r in results)
    # --- errors
    intended = {"ok", "disconnect", "cut_at_end"}
    queue_full_intended = a.allow_queue_full or (
        t.proc is not None and a.max_queue is not None and a.max_queue < a.clients
    )
    if queue_full_intended:
        intended.add(QUEUE_FULL)
    for kind, n in sorted(kinds.items()):
        if kind not in intended:
            ex = next(r for r in results if r.kind == kind)
            failures.append(
                f"{n} request(s) ended with {kind}; first: phase {ex.phase} client {ex.client} #{ex.seq} "
                f"{ex.spec.api} max_tokens={ex.spec.max_tokens}: {ex.detail}"
            )
    for ph in phases:
        if ph.name == "prime" and any(r.kind != "ok" for r in ph.results):
            failures.append("a prime request (ignore_eos, greedy) did not complete normally")
    if not any(r.ok for r in by_phase["load"].results):
        failures.append("no request of the load phase completed")
    # --- metrics during / after
    failures += sorted(set(s.violations))
    stuck = {g: after[g] for g in GAUGES if after.get(g, 0) != 0}
    if stuck:
        failures.append(f"after {a.settle:g} s of settling these gauges are not 0: {stuck}")
    # --- accounting
    exclusive = a.exclusive or t.proc is not None
    accepted = [r for r in results if r.status == 200]
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    completed_tokens = sum(r.completion_tokens or 0 for r in results if r.ok)
    dropped_budget = sum(r.spec.max_tokens for r in accepted if not r.ok)
    gen_delta = d.get("kapitsa_generation_tokens_total", 0)
    accounting = {
        "engine_finished": d.get("kapitsa_engine_requests_finished_total"),
        "engine_cancelled": d.get("kapitsa_engine_requests_cancelled_total"),
        "accepted_by_client_count": len(accepted),
        "generation_tokens": gen_delta,
        "completed_stream_tokens": completed_tokens,
        "dropped_streams_max_tokens": dropped_budget,
    }
    if exclusive:
        fin = d.get("kapitsa_engine_requests_finished_total", 0) + d.get("kapitsa_engine_requests_cancelled_total", 0)
        if fin != len(accepted):
            failures.append(
                f"the engine finished {d.get('kapitsa_engine_requests_finished_total', 0):g} and cancelled "
                f"{d.get('kapitsa_engine_requests_cancelled_total', 0):g} requests, but {len(accepted)} were accepted"
            )
        n_done = sum(1 for r in results if r.ok)
        if d.get("kapitsa_engine_requests_finished_total", 0) < n_done:
            failures.append(f"engine finished fewer requests than the {n_done} completed streams")
        if not completed_tokens <= gen_delta <= completed_tokens + dropped_budget:
            failures.append(
                f"kapitsa_generation_tokens_total grew by {gen_delta:g}, outside [{completed_tokens}, "
                f"{completed_tokens + dropped_budget}] (completed streams' tokens, plus max_tokens of dropped ones)"
            )
        for api, ep in (("chat", "/v1/chat/completions"), ("messages", "/v1/messages")):
            key = f'kapitsa_http_requests_total{{endpoint="{ep}",status="200"}}'
            want = sum(1 for r in accepted if r.spec.api == api)
            if d.get(key, 0) != want:
                failures.append(f"{key} grew by {d.get(key, 0):g}, {want} expected")
    # --- RSS
    rss = None
    if s.rss:
        start_k = s.rss[0][1]
        warm = [k for (ts, k) in s.rss if ts <= warm_until] or [start_k]
        late = [k for (ts, k) in s.rss if ts > warm_until] or [s.rss[-1][1]]
        base = max(warm)
        growth_k = max(late) - base
        rss = {
            "start_mib": round(start_k / 1024, 1),
            "warm_mib": round(base / 1024, 1),
            "peak_mib": round(max(k for _, k in s.rss) / 1024, 1),
            "end_mib": round(s.rss[-1][1] / 1024, 1),
            "growth_after_warmup_mib": round(growth_k / 1024, 1),
            "threshold_mib": a.rss_growth_mib,
            "samples": len(s.rss),
        }
        if growth_k > a.rss_growth_mib * 1024:
            failures.append(
                f"server RSS grew by {growth_k / 1024:.1f} MiB after warm-up (limit {a.rss_growth_mib} MiB): "
                f"warm {base / 1024:.1f} MiB, peak later {max(late) / 1024:.1f}, end {s.rss[-1][1] / 1024:.1f}"
            )
    else:
        notes.append("RSS not sampled (no --pid and no server started here)")
    if not has_blocks:
        notes.append("kapitsa_cache_blocks_used/total not exported by this server: block checks skipped")
    # --- greedy replay: load client 0 repeats the single phase's requests
    greedy_same = greedy_diff = 0
    if "single" in by_phase:
        solo = {r.seq: r for r in by_phase["single"].results if r.ok and r.spec.temperature == 0}
        for r in by_phase["load"].results:
            if r.client == 0 and r.ok and r.seq in solo:
                if r.text == solo[r.seq].text:
                    greedy_same += 1
                else:
                    greedy_diff += 1
    stats = {ph.name: phase_stats(ph) for ph in phases}
    speedup = None
    if "single" in stats and stats["single"]["gen_tokens_per_s"] and stats["load"]["gen_tokens_per_s"] is not None:
        speedup = round(stats["load"]["gen_tokens_per_s"] / stats["single"]["gen_tokens_per_s"], 2)
    speedup_cpu = None
    if "single" in stats and stats["single"]["gen_tokens_per_cpu_s"] and stats["load"]["gen_tokens_per_cpu_s"] is not None:
        speedup_cpu = round(stats["load"]["gen_tokens_per_cpu_s"] / stats["single"]["gen_tokens_per_cpu_s"], 2)
    if a.min_speedup is not None and (speedup is None or speedup < a.min_speedup):
        failures.append(f"aggregate / single-stream throughput {speedup} < --min-speedup {a.min_speedup}")
    # --- server process
    if t.proc is not None or a.server_log:
        if "panicked" in t.log():
            failures.append("the server printed a panic:\n" + "\n".join(l for l in t.log().splitlines() if "panick" in l)[:2000])
    if t.proc is not None:
        if not t.alive():
            failures.append(f"the server died during the run (exit {t.proc.returncode}):\n{t.log_tail()}")
    mean_load = statistics.mean(v for _, v in s.load) if s.load else None
    report = {
        "url": t.url,
        "model": t.model,
        "n_ctx": t.n_ctx,
        "server": {
            "started_here": t.proc is not None,
            "slots": slots,
            "max_running": a.max_running,
            "max_queue": a.max_queue,
            "max_batch_tokens": a.max_batch_tokens,
            "threads": a.threads,
            "extra_args": a.server_arg,
        },
        "mix": {
            "seed": a.seed,
            "clients": a.clients,
            "duration_s": a.duration,
            "single_duration_s": a.single_duration,
            "prompt_words": list(a.prompt_words),
            "max_tokens": list(a.max_tokens),
            "messages_fraction": a.messages_fraction,
            "greedy_fraction": a.greedy_fraction,
            "disconnect_fraction": a.disconnect_fraction,
        },
        "phases": stats,
        "speedup": speedup,
        "speedup_per_cpu_s": speedup_cpu,
        "errors": {k: v for k, v in sorted(kinds.items()) if k != "ok"},
        "queue_full_intended": queue_full_intended,
        "peaks_during_run": s.peaks,
        "metrics_after": {
            g: after.get(g) for g in GAUGES + ["kapitsa_cache_blocks_cached", "kapitsa_cache_blocks_total"] if g in after
        },
        "preemptions": d.get("kapitsa_preemptions_total"),
        "settle_s": round(settle_s, 2),
        "longest_engine_stall_s": round(s.longest_stall, 1),
        "accounting": accounting,
        "accounting_checked": exclusive,
        "rss": rss,
        "greedy_replay": {"same": greedy_same, "different": greedy_diff},
        "loadavg": {
            "start": load_start,
            "end": load_end,
            "mean": None if mean_load is None else round(mean_load, 2),
            "max": max((v for _, v in s.load), default=None),
        },
        "client_cpu_s": round(
            (rusage1.ru_utime - rusage0.ru_utime) + (rusage1.ru_stime - rusage0.ru_stime), 2
        ),
        "notes": notes,
        "failures": failures,
    }
    return report, failures


TABLE_HEAD = (
    "| clients | s | max-running | batch tokens | requests (done / dropped / cut / 429 / errors) | single t/s | "
    "aggregate t/s | x single | x single per server CPU s | server cores (single / load) | TTFT p50 / p95 s | "
    "RSS start / peak / end MiB | load avg |\n"
    "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: |"
)


def table_row(rep: dict) -> str:
    ld, sg = rep["phases"]["load"], rep["phases"].get("single", {})
    k = ld["kinds"]
    errs = sum(v for kk, v in k.items() if kk not in ("ok", "disconnect", "cut_at_end", QUEUE_FULL))
    rss = rep["rss"]
    rss_s = f"{rss['start_mib']:.0f} / {rss['peak_mib']:.0f} / {rss['end_mib']:.0f}" if rss else "-"
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)  # noqa: E731
    return (
        f"| {rep['mix']['clients']} | {rep['mix']['duration_s']:g} | {rep['server']['slots']} | "
        f"{f(rep['server']['max_batch_tokens'], '{}')} | {k.get('ok', 0)} / {k.get('disconnect', 0)} / {k.get('cut_at_end', 0)} / "
        f"{k.get(QUEUE_FULL, 0)} / {errs} | "
        f"{f(sg.get('gen_tokens_per_s'))} | {f(ld['gen_tokens_per_s'])} | {f(rep['speedup'], '{:.2f}')} | "
        f"{f(rep['speedup_per_cpu_s'], '{:.2f}')} | {f(sg.get('server_cpu_cores'), '{:.2f}')} / {f(ld['server_cpu_cores'], '{:.2f}')} | "
        f"{f(ld['ttft_p50_s'], '{:.2f}')} / {f(ld['ttft_p95_s'], '{:.2f}')} | {rss_s} | {f(rep['loadavg']['mean'], '{:.2f}')} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target (--url, or --kapitsa with --model)")
    g.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8080")
    g.add_argument("--pid", type=int, help="its process id, for the RSS checks")
    g.add_argument("--exclusive", action="store_true", help="nobody else uses that server: check the metric accounting")
    g.add_argument("--server-log", help="that server's stderr log: fail if it shows a panic")
    g.add_argument("--kapitsa", help="the kapitsa binary: start `kapitsa serve` on a free port")
    g.add_argument("--model", help="model file or directory for --kapitsa")
    g.add_argument("--api-key", default=os.environ.get("KAPITSA_API_KEY"))
    g.add_argument("--model-name", help="`model` to send (default: what /v1/models lists)")
    g.add_argument("--max-running", type=int)
    g.add_argument("--max-queue", type=int)
    g.add_argument("--max-batch-tokens", type=int)
    g.add_argument("--ctx-size", type=int)
    g.add_argument("--threads", type=int)
    g.add_argument("--server-arg", action="append", default=[], help="more `kapitsa serve` arguments (repeatable)")
    g.add_argument("--start-timeout", type=float, default=180.0)
    m = p.add_argument_group("load")
    m.add_argument("--clients", type=int, default=32)
    m.add_argument("--duration", type=float, default=60.0, help="seconds of the load phase")
    m.add_argument("--single-duration", type=float, default=20.0, help="seconds of the single-client phase (0: skip)")
    m.add_argument("--no-prime", action="store_true", help="skip the prime phase")
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--prompt-words", type=parse_range, default=(4, 200), help="words in the user message, MIN-MAX")
    m.add_argument("--max-tokens", type=parse_range, default=(16, 256), help="max_tokens, MIN-MAX")
    m.add_argument("--messages-fraction", type=float, default=0.25, help="share of /v1/messages requests")
    m.add_argument("--greedy-fraction", type=float, default=0.5, help="share of temperature-0 requests")
    m.add_argument("--disconnect-fraction", type=float, default=0.15, help="share of streams dropped on purpose")
    m.add_argument(
        "--drain", type=float, default=120.0, help="after a phase's deadline, seconds its requests in flight may finish before they are cut"
    )
    m.add_argument("--request-timeout", type=float, default=600.0, help="a request taking longer is a failure")
    c = p.add_argument_group("checks")
    c.add_argument("--allow-queue-full", action="store_true", help="429 answers are intended (small --max-queue)")
    c.add_argument("--warmup", type=float, default=10.0, help="seconds of the load phase still counted as warm-up for RSS")
    c.add_argument("--rss-growth-mib", type=float, default=64.0, help=RSS_HELP)
    c.add_argument("--settle", type=float, default=30.0, help="seconds to wait for the gauges to return to 0")
    c.add_argument("--stall", type=float, default=120.0, help="no engine step for this long while requests wait: a hang")
    c.add_argument("--min-speedup", type=float, help="fail if aggregate / single-stream t/s is below this")
    p.add_argument("--json", help="also write the JSON report to this file")
    a = p.parse_args(argv)
    if bool(a.url) == bool(a.kapitsa):
        p.error("give either --url or --kapitsa (with --model)")
    if a.kapitsa and not a.model:
        p.error("--kapitsa needs --model")
    if a.clients < 1 or a.duration <= 0:
        p.error("--clients and --duration must be positive")
    t = Target(a)
    if a.kapitsa:
        t.start()
    try:
        report, failures = asyncio.run(run(a, t))
    finally:
        code = t.stop()
    if t.proc is not None:
        report["server"]["exit_code"] = code
        if code != 0:
            failures.append(f"the server exited with {code} after SIGTERM (expected 0):\n{t.log_tail()}")
        if t.log_path and failures:
            report["server"]["log"] = t.log_path  # kept for the post-mortem
        elif t.log_path:
            os.unlink(t.log_path)
    report["ok"] = not failures
    text = json.dumps(report, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    print()
    print(TABLE_HEAD)
    print(table_row(report))
    print()
    for n in report["notes"]:
        print(f"note: {n}")
    if failures:
        for f_ in failures:
            print(f"FAIL: {f_}")
        return 1
    print("PASS: all checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
