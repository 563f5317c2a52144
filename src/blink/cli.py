"""``blink`` command line."""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
from contextlib import contextmanager

import numpy as np

_ring_numbers = itertools.count()


@contextmanager
def standin_engine(geometry, **consumer_options):
    """A fresh shared-memory ring, served from another process by the reference consumer and its stand-in model.

    Yields ``(memory, process)``; on exit asks the consumer to shut down, then removes the ring.
    """
    from blink.device.reference import serve_shared_ring
    from blink.device.ring import CONTROL_DTYPE, RingLayout
    from blink.nic.transport import SharedMemory

    layout = RingLayout(geometry)
    name = f"blink-{os.getpid()}-{next(_ring_numbers)}"
    with SharedMemory.create(name, layout.size) as memory:
        memory.write(0, layout.control_bytes())
        consumer = mp.get_context("spawn").Process(target=serve_shared_ring, args=(name, geometry),
                                                   kwargs=consumer_options, daemon=True)
        consumer.start()
        print(f"ring /dev/shm/{name}: {layout.size / 2**20:.1f} MiB, {geometry.n_slots} slots; "
              f"stand-in engine pid {consumer.pid}", file=sys.stderr)
        try:
            yield memory, consumer
        finally:
            memory.write(CONTROL_DTYPE.fields["shutdown"][1], np.array([1], "<u4").tobytes())
            consumer.join(10)
            consumer.kill()


def wait_until_serving(agent, engine=None, timeout_s: float = 120.0) -> None:
    """Block until the ring's engine reports it is serving; ``SystemExit`` saying why if it does not."""
    from blink.device.ring import ENGINE_STARTING

    deadline = time.monotonic() + timeout_s
    while agent.stats()["engine_state"] == ENGINE_STARTING:
        if engine is not None and not engine.is_alive():
            raise SystemExit(f"the engine process exited (code {engine.exitcode}) before it started serving")
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine did not start serving within {timeout_s:.0f} s: is it running on this ring?")
        time.sleep(0.01)


def ring_demo(args) -> int:
    """Agent in this process, the reference consumer (playing the GPU) in another, over POSIX shared memory."""
    from blink.config import SamplingParams
    from blink.device.ring import RingGeometry
    from blink.device.standin import standin_continuation
    from blink.errors import RingFull
    from blink.nic.agent import Agent

    geometry = RingGeometry(n_slots=args.slots, max_prompt_tokens=64, max_output_tokens=args.max_tokens)
    rng = np.random.default_rng(args.seed)
    with standin_engine(geometry) as (memory, _):
        agent = Agent(memory, geometry)
        expected, answered, finished, tokens = {}, {}, 0, 0
        start = last_report = time.monotonic()
        while finished < args.requests:
            while len(expected) < args.requests:
                prompt = rng.integers(0, 32000, rng.integers(1, 65)).tolist()
                params = SamplingParams(max_tokens=int(rng.integers(1, args.max_tokens + 1)),
                                        seed=int(rng.integers(0, 2**63)), ignore_eos=True)
                try:
                    expected[agent.submit(prompt, params)] = (prompt, params)
                except RingFull:
                    break
            for out in agent.poll():
                answered.setdefault(out.request_id, []).extend(out.new_tokens)
                tokens += len(out.new_tokens)
                finished += out.finished
            now = time.monotonic()
            if now - last_report >= 0.5 or finished == args.requests:
                print(f"  {now - start:6.2f} s  submitted {len(expected):6d}  in flight {agent.in_flight:5d}  "
                      f"tokens {tokens:8d}  ({tokens / (now - start):,.0f} tok/s)")
                last_report = now
        wrong = [rid for rid, (prompt, params) in expected.items()
                 if answered[rid] != standin_continuation(prompt, params.seed, params.max_tokens)]
        elapsed = time.monotonic() - start
        print(f"{args.requests} requests, {tokens} tokens in {elapsed:.2f} s "
              f"({args.requests / elapsed:,.0f} req/s); wrong outputs: {len(wrong)}")
        return 1 if wrong else 0


def serve(args) -> int:
    """The engine in another process and the agent's HTTP server in this one, over a shared-memory ring."""
    from blink.device.ring import RingGeometry
    from blink.nic.text import Tokenizer

    if not args.standin:
        print("blink serve: the GPU engine is not built yet; pass --standin to serve the stand-in model "
              "(deterministic hash tokens) through the whole HTTP path", file=sys.stderr)
        return 2
    model_dir = _model_dir(args.model)
    tokenizer = Tokenizer(model_dir)
    geometry = RingGeometry(n_slots=args.slots, max_prompt_tokens=args.max_prompt_tokens,
                            max_output_tokens=args.max_output_tokens)
    # The stand-in draws tokens from the tokenizer's whole vocabulary, so every token it emits decodes.
    with standin_engine(geometry, vocab_size=tokenizer.vocab_size,
                        eos_token_ids=tokenizer.eos_token_ids) as (memory, engine):
        return _serve_http(args, memory, geometry, tokenizer, model_dir, engine)


def agent(args) -> int:
    """Attach to the shared-memory ring of an engine that is already running and serve HTTP on it."""
    from blink.nic.text import Tokenizer
    from blink.nic.transport import SharedMemory

    model_dir = _model_dir(args.model)
    with SharedMemory.open(args.ring) as memory:
        return _serve_http(args, memory, _ring_geometry(memory), Tokenizer(model_dir), model_dir, None)


def _serve_http(args, memory, geometry, tokenizer, model_dir, engine) -> int:
    import logging
    from pathlib import Path

    from blink.nic.agent import Agent
    from blink.nic.server import OpenAIServer, ServerConfig, run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)      # keep the agent off the engine's cores
    agent = Agent(memory, geometry)
    wait_until_serving(agent, engine)
    config = ServerConfig(model_name=args.served_model_name or Path(model_dir).name, max_queued=args.max_queued)
    run(OpenAIServer(agent, tokenizer, config), args.host, args.port)
    return 0


def _model_dir(model):
    if model is not None:
        return model
    from blink.models import default_model_path
    return default_model_path()


def _ring_geometry(memory):
    """The geometry an existing ring's creator wrote into its control block."""
    from blink.device.ring import CONTROL_DTYPE, MAGIC, RING_LOGPROBS, RingGeometry

    control = np.frombuffer(memory.read(0, CONTROL_DTYPE.itemsize), CONTROL_DTYPE)[0]
    if int(control["magic"]) != MAGIC:
        raise SystemExit(f"/dev/shm/{memory.name} is not a blink ring (or its engine has not initialised it yet)")
    return RingGeometry(n_slots=int(control["n_slots"]), max_prompt_tokens=int(control["max_prompt_tokens"]),
                        max_output_tokens=int(control["max_output_tokens"]),
                        max_stop_ids=int(control["max_stop_ids"]),
                        logprobs=bool(int(control["flags"]) & RING_LOGPROBS))


def _cpu_list(text: str) -> set[int]:
    return {int(c) for c in text.split(",")}


def _http_options(parser) -> None:
    parser.add_argument("--model", default=None, help="model directory (HF layout); default: the embedded SmolLM2")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the dir name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queued", type=int, default=1024,
                        help="requests that may wait in the agent for a free ring slot; beyond it: 429")
    parser.add_argument("--cpus", type=_cpu_list, default=None, help="pin the agent to these cores, e.g. 2,3")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="blink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("ring-demo", help="agent and reference consumer in two processes over shared memory")
    demo.add_argument("--requests", type=int, default=5000)
    demo.add_argument("--slots", type=int, default=1024)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=ring_demo)
    serve_cmd = sub.add_parser("serve", help="engine + OpenAI-compatible HTTP server (agent) over a shared ring")
    _http_options(serve_cmd)
    serve_cmd.add_argument("--standin", action="store_true",
                           help="run the reference consumer with the stand-in model as the engine")
    serve_cmd.add_argument("--slots", type=int, default=256)
    serve_cmd.add_argument("--max-prompt-tokens", type=int, default=2048)
    serve_cmd.add_argument("--max-output-tokens", type=int, default=2048)
    serve_cmd.set_defaults(run=serve)
    agent_cmd = sub.add_parser("agent", help="OpenAI-compatible HTTP server on the ring of a running engine")
    _http_options(agent_cmd)
    agent_cmd.add_argument("--ring", required=True, help="the engine's shared-memory ring name (/dev/shm/NAME)")
    agent_cmd.set_defaults(run=agent)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
