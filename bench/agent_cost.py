"""The agent's CPU time per request and per 1,000 streamed tokens, under ``blink bench serve`` load.

    PYTHONPATH=src python -m bench.agent_cost [--tree DIR] [--reps 5] [--json out.json]

``blink serve --standin`` of the tree at DIR (default: this one) with its stand-in paced like a GPU's decode step
(``--standin-step-ms 10``, so a poll finds about one token per stream, as behind a real engine) and the agent at
normal priority; then ``blink bench serve`` closed loop at 64 streams, 256 requests of 16 output tokens and 256 of
128. The agent's CPU is the server process's utime + stime (``/proc/PID/stat``: every thread of it; the stand-in is
a process of its own) around each run, so a tree without ``process_cpu_seconds_total`` measures too. The marginal
cost of a token is the difference of the two runs over the difference of their tokens; a request's cost is the
short run's rest per request (HTTP, parsing, submission, its first and last chunks), and, measured directly, the CPU
per request of a third run of 1,024 requests of one output token each. Medians over ``--reps``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.wait_healthy import healthy

STREAMS, REQUESTS, SHORT, LONG = 64, 256, 16, 128
ONE_TOKEN_REQUESTS = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(tree: Path, env: dict, port: int, output_len: int, requests: int = REQUESTS) -> int:
    """One closed-loop run; the output tokens it got."""
    done = subprocess.run([sys.executable, "-m", "blink.cli", "bench", "serve", "--base-url",
                           f"http://127.0.0.1:{port}", "--num-prompts", str(requests), "--max-concurrency",
                           str(STREAMS), "--output-len", str(output_len), "--ignore-eos"],
                          env=env, cwd=tree, capture_output=True, text=True, check=True)
    return int(re.findall(r"Total generated tokens:\s+(\d+)", done.stdout)[-1])


def measure(tree: Path, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                               "--slots", str(STREAMS), "--max-prompt-tokens", "1024", "--max-output-tokens", "2048",
                               "--standin-step-ms", "10", "--agent-priority", "normal"],
                              env=env, cwd=tree, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"blink serve --standin of {tree} did not become healthy")
            time.sleep(0.2)
        bench(tree, env, port, 8, STREAMS)          # warm-up: imports and first allocations
        per_request, per_1k, one_token = [], [], []
        for _ in range(reps):
            runs = []
            for output_len in (SHORT, LONG):
                before = cpu_seconds(server.pid)
                runs.append((bench(tree, env, port, output_len), cpu_seconds(server.pid) - before))
            (short_tokens, short_cpu), (long_tokens, long_cpu) = runs
            token = (long_cpu - short_cpu) / (long_tokens - short_tokens)
            per_1k.append(token * 1e6)
            per_request.append((short_cpu - token * short_tokens) / REQUESTS * 1e3)
            before = cpu_seconds(server.pid)
            bench(tree, env, port, 1, ONE_TOKEN_REQUESTS)
            one_token.append((cpu_seconds(server.pid) - before) / ONE_TOKEN_REQUESTS * 1e3)
            print(f"cpu/request {per_request[-1]:6.2f} ms   cpu/1k streamed tokens {per_1k[-1]:6.1f} ms   "
                  f"cpu per 1-token request {one_token[-1]:6.2f} ms", flush=True)
    finally:
        server.terminate()
        server.wait()
    return {"tree": str(tree), "reps": reps, "cpu_ms_per_request": per_request, "cpu_ms_per_1k_tokens": per_1k,
            "cpu_ms_per_one_token_request": one_token,
            "median_cpu_ms_per_request": statistics.median(per_request),
            "median_cpu_ms_per_1k_tokens": statistics.median(per_1k),
            "median_cpu_ms_per_one_token_request": statistics.median(one_token)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository tree whose agent is measured")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()
    result = {"cpus": os.cpu_count(), **measure(args.tree.resolve(), args.reps)}
    print(f"median: {result['median_cpu_ms_per_request']:.2f} ms per request, "
          f"{result['median_cpu_ms_per_1k_tokens']:.1f} ms per 1,000 streamed tokens, "
          f"{result['median_cpu_ms_per_one_token_request']:.2f} ms per 1-token request")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
