"""The agent's CPU time per request and per 1,000 streamed tokens, under ``blink bench serve`` load.

    PYTHONPATH=src python -m bench.agent_cost [--tree DIR] [--reps 5] [--model DIR] [--json out.json]
        [--saturate [--clients 4]]

``blink serve --standin`` of the tree at DIR (default: this one), one agent process, with its stand-in paced like a
GPU's decode step (``--standin-step-ms 10``, so a poll finds about one token per stream, as behind a real engine) and
the agent at normal priority; then ``blink bench serve`` closed loop at 64 streams, 256 requests of 16 output tokens
and 256 of 128. The agent's CPU is the server process's utime + stime (``/proc/PID/stat``: every thread of it; the
stand-in is a process of its own) around each run, so a tree without ``process_cpu_seconds_total`` measures too. The
marginal cost of a token is the difference of the two runs over the difference of their tokens; a request's cost is
the short run's rest per request (HTTP, parsing, submission, its first and last chunks), and, measured directly, the
CPU per request of a third run of 1,024 requests of one output token each. Medians over ``--reps``. ``--model``: the
tokenizer of that model directory, in the server and the client (default: the embedded model's).

``--saturate``: the tokens/s one agent process streams at most. ``blink serve --standin`` with 512 slots, one agent
process and the stand-in stepping at most every millisecond (its step, numpy over the running requests, takes
~0.2 ms at 512 of them: it must keep ahead of the agent, see its CPU share below); ``--clients`` client
processes (4) keep 512 streams of 128 output tokens busy, so that no client is the limit. Over a 5 s window, 3 s
after the clients start, it reads the engine's token counter (``blink_generation_tokens_total``: in a closed loop
the tokens streamed) and the agent's CPU: tokens/s, the agent's share of a core (near 1.0: the agent was the limit,
unless the stand-in's share, also printed, is near 1.0 too: a poll finds fewer tokens when the stand-in steps late,
and an agent polling on costs more per token) and its CPU per 1,000 tokens. The clients are stopped after the
window. It needs cores for the clients and the stand-in beside the agent's to mean that.
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
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from bench.wait_healthy import healthy

STREAMS, REQUESTS, SHORT, LONG = 64, 256, 16, 128
ONE_TOKEN_REQUESTS = 1024
SATURATING_STREAMS, SATURATING_STEP_MS, SATURATING_RAMP_S, SATURATING_WINDOW_S = 512, 1, 3.0, 5.0
SATURATING_REQUESTS_PER_STREAM = 40    # more than a window takes at 300k tokens/s; the clients are stopped after it
TOKENS = "blink_generation_tokens_total"    # the engine's count of generated tokens, on /metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def standin_pid(server_pid: int) -> int:
    """The stand-in engine's process: the one child of a one-agent ``serve --standin`` that ``multiprocessing``
    spawned (the others are its resource tracker, or none)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    spawned = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    if len(spawned) != 1:
        raise SystemExit(f"expected one stand-in process under the server {server_pid}, found {spawned}")
    return spawned[0]


def client_command(port: int, model: Path | None, output_len: int, requests: int, streams: int) -> list[str]:
    """The command of a ``blink bench serve`` closed loop against ``port``, reading ``model``'s tokenizer, as the
    server does (None: the embedded model's)."""
    return [sys.executable, "-m", "blink.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            "--num-prompts", str(requests), "--max-concurrency", str(streams), "--output-len", str(output_len),
            "--ignore-eos", *(("--tokenizer", str(model)) if model is not None else ())]


def bench(tree: Path, env: dict, port: int, model: Path | None, output_len: int, requests: int = REQUESTS,
          streams: int = STREAMS) -> str:
    """One closed-loop run; the client's result block."""
    return subprocess.run(client_command(port, model, output_len, requests, streams), env=env, cwd=tree,
                          capture_output=True, text=True, check=True).stdout


def tokens(result: str) -> int:
    """The output tokens a client's result block reports."""
    return int(re.findall(r"Total generated tokens:\s+(\d+)", result)[-1])


@contextmanager
def standin_server(tree: Path, env: dict, port: int, slots: int, step_ms: float, model: Path | None):
    """``blink serve --standin`` of ``tree`` on ``port``, one agent process, with ``model``'s tokenizer (None: the
    embedded model's), healthy and warmed up; yields its process."""
    extra = ("--model", str(model)) if model is not None else ()
    # One agent process, whose CPU is the server process's: a tree from before agent processes serves with one, a
    # later one would choose several on a host of many cores.
    if "--agent-processes" in (tree / "src/blink/cli.py").read_text():
        extra = ("--agent-processes", "1", *extra)
    server = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                               "--slots", str(slots), "--max-prompt-tokens", "1024", "--max-output-tokens", "2048",
                               "--standin-step-ms", str(step_ms), "--agent-priority", "normal", *extra],
                              env=env, cwd=tree, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"blink serve --standin of {tree} did not become healthy")
            time.sleep(0.2)
        bench(tree, env, port, model, 8, slots, slots)     # warm-up: imports and first allocations
        yield server
    finally:
        server.terminate()
        server.wait()


def scraped(port: int, name: str) -> float:
    """The value of counter ``name`` on the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return float(re.findall(rf"^{name} (\S+)$", response.read().decode(), re.M)[-1])


def saturate(tree: Path, reps: int, model: Path | None, clients: int) -> dict:
    """One agent process's streamed tokens/s (the engine's token counter) and CPU share over a window of
    ``SATURATING_WINDOW_S`` while ``clients`` client processes keep ``SATURATING_STREAMS`` streams busy."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    port = free_port()
    rates, shares, engine_shares, per_1k = [], [], [], []
    streams = SATURATING_STREAMS // clients
    command = client_command(port, model, LONG, SATURATING_REQUESTS_PER_STREAM * streams, streams)
    with standin_server(tree, env, port, SATURATING_STREAMS, SATURATING_STEP_MS, model) as server:
        engine = standin_pid(server.pid)
        for _ in range(reps):
            running = [subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL) for _ in range(clients)]
            try:
                time.sleep(SATURATING_RAMP_S)
                before = time.monotonic(), scraped(port, TOKENS), cpu_seconds(server.pid), cpu_seconds(engine)
                time.sleep(SATURATING_WINDOW_S)
                after = time.monotonic(), scraped(port, TOKENS), cpu_seconds(server.pid), cpu_seconds(engine)
                if any(client.poll() is not None for client in running):
                    raise SystemExit("a client ended before the window did: it failed, or ran out of requests")
            finally:
                for client in running:
                    client.terminate()
                    client.wait()
            wall, streamed, cpu, engine_cpu = (b - a for a, b in zip(before, after))
            rates.append(streamed / wall)
            shares.append(cpu / wall)
            engine_shares.append(engine_cpu / wall)
            per_1k.append(cpu / streamed * 1e6)
            print(f"{rates[-1]:10.1f} tokens/s   agent CPU {shares[-1]:.2f} of a core, {per_1k[-1]:.1f} ms per "
                  f"1,000 tokens; stand-in CPU {engine_shares[-1]:.2f} of a core", flush=True)
            time.sleep(SATURATING_RAMP_S)       # the cancelled requests drain
    return {"tree": str(tree), "model": str(model), "reps": reps, "streams": SATURATING_STREAMS, "clients": clients,
            "step_ms": SATURATING_STEP_MS, "window_s": SATURATING_WINDOW_S,
            "tokens_per_s": rates, "agent_cpu_share": shares, "standin_cpu_share": engine_shares,
            "cpu_ms_per_1k_tokens": per_1k,
            "median_tokens_per_s": statistics.median(rates), "median_agent_cpu_share": statistics.median(shares),
            "median_cpu_ms_per_1k_tokens": statistics.median(per_1k)}


def measure(tree: Path, reps: int, model: Path | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    port = free_port()
    with standin_server(tree, env, port, STREAMS, 10, model) as server:
        per_request, per_1k, one_token = [], [], []
        for _ in range(reps):
            runs = []
            for output_len in (SHORT, LONG):
                before = cpu_seconds(server.pid)
                runs.append((tokens(bench(tree, env, port, model, output_len)), cpu_seconds(server.pid) - before))
            (short_tokens, short_cpu), (long_tokens, long_cpu) = runs
            token = (long_cpu - short_cpu) / (long_tokens - short_tokens)
            per_1k.append(token * 1e6)
            per_request.append((short_cpu - token * short_tokens) / REQUESTS * 1e3)
            before = cpu_seconds(server.pid)
            bench(tree, env, port, model, 1, ONE_TOKEN_REQUESTS)
            one_token.append((cpu_seconds(server.pid) - before) / ONE_TOKEN_REQUESTS * 1e3)
            print(f"cpu/request {per_request[-1]:6.2f} ms   cpu/1k streamed tokens {per_1k[-1]:6.1f} ms   "
                  f"cpu per 1-token request {one_token[-1]:6.2f} ms", flush=True)
    return {"tree": str(tree), "model": str(model), "reps": reps, "cpu_ms_per_request": per_request,
            "cpu_ms_per_1k_tokens": per_1k,
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
    parser.add_argument("--saturate", action="store_true", help="measure the tokens/s one agent process streams")
    parser.add_argument("--clients", type=int, default=4, help="--saturate: client processes (512 streams in all)")
    parser.add_argument("--model", type=Path, default=None, help="the model directory whose tokenizer "
                        "the agent uses (default: the embedded SmolLM2's; e.g. a blink.bench.shapes directory)")
    args = parser.parse_args()
    model = args.model and args.model.resolve()     # the server and the client run in the measured tree
    if args.saturate:
        result = {"cpus": os.cpu_count(), **saturate(args.tree.resolve(), args.reps, model, args.clients)}
        print(f"median: {result['median_tokens_per_s']:.1f} tokens/s, agent CPU "
              f"{result['median_agent_cpu_share']:.2f} of a core, {result['median_cpu_ms_per_1k_tokens']:.1f} ms per "
              "1,000 tokens")
    else:
        result = {"cpus": os.cpu_count(), **measure(args.tree.resolve(), args.reps, model)}
        print(f"median: {result['median_cpu_ms_per_request']:.2f} ms per request, "
              f"{result['median_cpu_ms_per_1k_tokens']:.1f} ms per 1,000 streamed tokens, "
              f"{result['median_cpu_ms_per_one_token_request']:.2f} ms per 1-token request")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
