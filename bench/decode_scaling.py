#!/usr/bin/env python3
"""Decode scaling of `kapitsa serve`: how much more the engine generates when it decodes B
sequences at once instead of one. It starts a server (`--max-running` = the largest B), and for
each B runs B greedy completions with one-token prompts and `ignore_eos` (so the window holds no
prefill), waits until all of them stream, then measures for `--window` seconds:

- engine steps and generated tokens per wall second (from /metrics);
- server CPU time (/proc/PID/stat): cores used, tokens per CPU second and CPU ms per step.

Tokens per CPU second are what to compare on a shared machine (the server gets only part of
the cores there). Their ratio between B and 1 is the most a load of B streams can gain over a
single stream (prefill costs about as much per token as batched decode, so a prompt-heavy mix
gains less); `bench/load.py` measures a realistic mix.

    python bench/decode_scaling.py --kapitsa target/release/kapitsa --model MODEL.gguf [--batches 1,4,8,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


async def measure(url: str, pid: int, batches: list[int], window: float) -> list[dict]:
    out = []
    async with httpx.AsyncClient(timeout=3600, trust_env=False) as c:
        deadline = time.monotonic() + 300
        while True:
            try:
                if (await c.get(url + "/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            await asyncio.sleep(0.5)
        model = (await c.get(url + "/v1/models")).json()["data"][0]["id"]

        async def counters() -> dict[str, float]:
            text = (await c.get(url + "/metrics")).text
            return {k: float(v) for k, v in re.findall(r"^(kapitsa_\w+) (\S+)$", text, re.M)}

        for b in batches:
            streaming = 0

            async def one(i: int) -> None:
                nonlocal streaming
                body = {"model": model, "prompt": str(i), "max_tokens": 1 << 20, "ignore_eos": True, "temperature": 0, "stream": True}
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    first = True
                    async for line in r.aiter_lines():
                        if first and line.startswith("data:"):
                            streaming += 1
                            first = False

            tasks = [asyncio.create_task(one(i)) for i in range(b)]
            while streaming < b:
                await asyncio.sleep(0.2)
            m0, c0, t0, l0 = await counters(), cpu_seconds(pid), time.monotonic(), loadavg()
            await asyncio.sleep(window)
            m1, c1, t1, l1 = await counters(), cpu_seconds(pid), time.monotonic(), loadavg()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            w, cpu = t1 - t0, c1 - c0
            steps = m1["kapitsa_engine_steps_total"] - m0["kapitsa_engine_steps_total"]
            toks = m1["kapitsa_generation_tokens_total"] - m0["kapitsa_generation_tokens_total"]
            row = {
                "batch": b,
                "running": m1["kapitsa_requests_running"],
                "steps_per_s": round(steps / w, 2),
                "tokens_per_s": round(toks / w, 2),
                "server_cores": round(cpu / w, 2),
                "tokens_per_cpu_s": round(toks / cpu, 2) if cpu else None,
                "cpu_ms_per_step": round(1000 * cpu / steps, 1) if steps else None,
                "loadavg": [l0, l1],
            }
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            # Let the cancellations reach the engine before the next batch.
            while (await counters())["kapitsa_requests_running"] > 0:
                await asyncio.sleep(0.5)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kapitsa", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,4,8,16", help="comma-separated B values")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per B")
    p.add_argument("--threads", type=int)
    p.add_argument("--server-arg", action="append", default=[])
    a = p.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    cmd = [a.kapitsa, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", "0", "--max-running", str(max(batches))]
    if a.threads is not None:
        cmd += ["--threads", str(a.threads)]
    for s in a.server_arg:
        cmd += s.split()
    log = tempfile.NamedTemporaryFile("w+", prefix="kapitsa-scaling-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("kapitsa serve did not start:\n" + open(log.name).read())
            m = re.search(r"on (http://\S+)", open(log.name).read())
            url = m.group(1) if m else None
            time.sleep(0.2)
        rows = asyncio.run(measure(url, proc.pid, batches, a.window))
    finally:
        proc.terminate()
        proc.wait()
        os.unlink(log.name)
    base = rows[0]["tokens_per_cpu_s"] if rows and rows[0]["batch"] == 1 else None
    print("| B | steps/s | tokens/s | server cores | tokens / CPU s | x B=1 (per CPU s) | CPU ms / step |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        x = f"{r['tokens_per_cpu_s'] / base:.2f}" if base and r["tokens_per_cpu_s"] else "-"
        print(
            f"| {r['batch']} | {r['steps_per_s']} | {r['tokens_per_s']} | {r['server_cores']} | "
            f"{r['tokens_per_cpu_s']} | {x} | {r['cpu_ms_per_step']} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
