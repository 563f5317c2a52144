"""``blink`` command line."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np


def ring_demo(args) -> int:
    """Agent in this process, the reference consumer (playing the GPU) in another, over POSIX shared memory."""
    from blink.config import SamplingParams
    from blink.device.reference import serve_shared_ring
    from blink.device.ring import RingGeometry, RingLayout
    from blink.device.standin import standin_continuation
    from blink.errors import RingFull
    from blink.nic.agent import Agent
    from blink.nic.transport import SharedMemory

    geometry = RingGeometry(n_slots=args.slots, max_prompt_tokens=64, max_output_tokens=args.max_tokens)
    layout = RingLayout(geometry)
    name = f"blink-demo-{os.getpid()}"
    rng = np.random.default_rng(args.seed)
    with SharedMemory.create(name, layout.size) as memory:
        memory.write(0, layout.control_bytes())
        consumer = mp.get_context("spawn").Process(target=serve_shared_ring, args=(name, geometry), daemon=True)
        consumer.start()
        print(f"ring /dev/shm/{name}: {layout.size / 2**20:.1f} MiB, {args.slots} slots; consumer pid {consumer.pid}")
        try:
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
            agent.request_shutdown()
            consumer.join(10)
            return 1 if wrong else 0
        finally:
            consumer.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="blink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("ring-demo", help="agent and reference consumer in two processes over shared memory")
    demo.add_argument("--requests", type=int, default=5000)
    demo.add_argument("--slots", type=int, default=1024)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=ring_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
