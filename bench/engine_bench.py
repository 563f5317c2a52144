"""Engine on the GPU: the engine process's CPU time while 64 requests decode, and tokens/s under memory hogs.

Method (one run, JSON to ``--json``):

- The engine runs in its own process on a shared-memory ring (``blink.host.process.engine_process``, as ``blink serve``
  runs it); this process is the agent. It keeps ``--requests`` requests in the ring (random prompts of 16 tokens,
  ``ignore_eos``, ``--max-tokens`` each, resubmitted as they finish), so the GPU always decodes that many sequences.
- ``isolated``: after a warm-up, over a ``--window``-second window: the engine process's CPU time (utime + stime of
  ``/proc/<pid>/stat``, all its threads) per second of wall time, and tokens/s (the ring's ``tokens`` counter, which
  the GPU scheduler bumps).
- ``hogs``: the same with 4 x (number of cores) processes copying 64 MiB numpy arrays in a loop (the interference
  protocol of DESIGN.md section 6), started before the window.

Correctness of what is measured: ``tests/test_engine.py`` (``-m gpu``: greedy tokens equal transformers').
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from blink.bench.interference import MEMORY_COPY, interference


def bench_model(model: str | None) -> tuple[str, str]:
    """(model directory, load format): ``model``; else the embedded SmolLM2; else its shape with random weights (the
    GPU machine has no copy of the checkpoint: a config.json in a temporary directory)."""
    import tempfile

    from blink.models import ModelConfig, default_model_path

    if model is not None:
        return model, "auto"
    try:
        return str(default_model_path()), "auto"
    except FileNotFoundError:
        smollm2 = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                              rope_theta=1e5, rotary_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                              dtype="float32")
        directory = tempfile.mkdtemp(prefix="blink-smollm2-shape-")
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(smollm2.to_hf(), f)
        return directory, "dummy"


def engine_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread, exited ones included) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Load:
    """Keeps ``n`` requests in the ring through one agent."""

    def __init__(self, agent, n: int, max_tokens: int, vocab: int):
        from blink.ring.request import SamplingParams

        self.agent, self.n, self.rng = agent, n, np.random.default_rng(0)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
        self.vocab = vocab

    def pump(self) -> None:
        """Top the ring up to ``n`` requests and drain outputs (one poll)."""
        while self.agent.in_flight < self.n:
            self.agent.submit(self.rng.integers(0, self.vocab, 16).tolist(), self.params)
        self.agent.poll()

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.pump()
            time.sleep(1e-3)


def measure(load: Load, pid: int, window_s: float) -> dict:
    stats = load.agent.stats
    cpu0, tokens0, t0, mine0 = engine_cpu_s(pid), stats()["tokens"], time.monotonic(), time.process_time()
    load.run_for(window_s)
    cpu1, tokens1, t1, mine1 = engine_cpu_s(pid), stats()["tokens"], time.monotonic(), time.process_time()
    return {"window_s": t1 - t0, "tokens_per_s": (tokens1 - tokens0) / (t1 - t0),
            "engine_cpu_ms_per_s": 1e3 * (cpu1 - cpu0) / (t1 - t0),
            "agent_cpu_ms_per_s": 1e3 * (mine1 - mine0) / (t1 - t0), "running": stats()["running"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "out"), "engine_bench.json"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--hogs", type=int, default=4 * os.cpu_count())
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the method (no meaningful numbers)")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2 if it is "
                        "installed, else random weights of its shape)")
    args = parser.parse_args()

    from blink.config import EngineConfig
    from blink.models import ModelConfig
    from blink.nic.agent import Agent
    from blink.host.process import engine_process

    model, load_format = bench_model(args.model)
    config = EngineConfig(model=str(model), load_format=load_format, device=args.device, n_slots=256,
                          max_prompt_tokens=64,
                          max_output_tokens=args.max_tokens, gpu_memory_utilization=0.5,
                          ring_name=f"blink-bench-{os.getpid()}")
    result = {"config": dataclasses.asdict(config), "requests": args.requests,
              "max_tokens": args.max_tokens, "hogs": args.hogs}
    started = time.monotonic()
    with engine_process(config) as (memory, process):
        agent = Agent.attach(memory, liveness_timeout_s=60)
        load = Load(agent, args.requests, args.max_tokens, ModelConfig.from_file(model).vocab_size)
        while agent.stats()["engine_state"] == 0:
            time.sleep(0.05)
        result["start_s"] = time.monotonic() - started
        load.run_for(args.warmup)
        result["isolated"] = measure(load, process.pid, args.window)
        print(json.dumps(result["isolated"]), flush=True)
        with interference(args.hogs, programs=(MEMORY_COPY,)):
            load.run_for(args.warmup)
            result["hogs"] = measure(load, process.pid, args.window)
        print(json.dumps(result["hogs"]), flush=True)
        result["hog_ratio"] = result["hogs"]["tokens_per_s"] / result["isolated"]["tokens_per_s"]
        result["stats"] = agent.stats()
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("start_s", "hog_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
