"""A CI-sized run of bench/load.py against the SDK suite's server (8 streaming clients for
15 s on the real 0.5B model, plus its prime and single-client phases: about 40 s on a quiet
machine). The full run (32 clients, 60 s) is documented in bench/README.md."""

import os
import subprocess
import sys
from pathlib import Path

LOAD = Path(__file__).resolve().parents[2] / "bench" / "load.py"


def test_load(base_url, api_key):
    cmd = [
        sys.executable,
        str(LOAD),
        "--url", base_url,
        "--api-key", api_key,
        # Nothing else talks to this server while the test runs (pytest runs one test at a
        # time), so the metric accounting is checked too.
        "--exclusive",
        "--clients", "8",
        "--duration", "15",
        "--single-duration", "5",
        "--warmup", "5",
        "--prompt-words", "4-40",
        "--max-tokens", "8-32",
        "--drain", "60",
        "--settle", "20",
    ]
    # Set by scripts/sdk-tests.sh: RSS sampling and the panic check of the server log.
    if os.environ.get("KAPITSA_SERVER_PID"):
        cmd += ["--pid", os.environ["KAPITSA_SERVER_PID"]]
    if os.environ.get("KAPITSA_SERVER_LOG"):
        cmd += ["--server-log", os.environ["KAPITSA_SERVER_LOG"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(r.stdout)
    print(r.stderr, file=sys.stderr)
    assert r.returncode == 0, "bench/load.py failed:\n" + "\n".join(
        l for l in r.stdout.splitlines() if l.startswith(("FAIL", "note"))
    )
    assert "PASS: all checks" in r.stdout
