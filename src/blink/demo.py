"""``blink ring-demo``: the ring contract end to end without a model or a GPU, with its throughput."""
from __future__ import annotations

import time

import numpy as np

from blink.errors import RingFull
from blink.nic.agent import Agent
from blink.ring.geometry import RingGeometry
from blink.ring.reference import standin_engine
from blink.ring.request import SamplingParams
from blink.ring.standin import standin_continuation


def ring_demo(slots: int, requests: int, max_tokens: int, seed: int) -> int:
    """``requests`` random prompts through a ring of ``slots``: the agent in this process, the reference consumer
    (playing the GPU) in another, over POSIX shared memory; every output is checked against the stand-in model.
    Returns the exit code: 1 if any output was wrong."""
    geometry = RingGeometry(n_slots=slots, max_prompt_tokens=64, max_output_tokens=max_tokens)
    rng = np.random.default_rng(seed)
    with standin_engine(geometry) as (memory, _):
        agent = Agent(memory, geometry)
        expected, answered, finished, tokens = {}, {}, 0, 0
        start = last_report = time.monotonic()
        while finished < requests:
            while len(expected) < requests:
                prompt = rng.integers(0, 32000, rng.integers(1, 65)).tolist()
                params = SamplingParams(max_tokens=int(rng.integers(1, max_tokens + 1)),
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
            if now - last_report >= 0.5 or finished == requests:
                print(f"  {now - start:6.2f} s  submitted {len(expected):6d}  in flight {agent.in_flight:5d}  "
                      f"tokens {tokens:8d}  ({tokens / (now - start):,.0f} tok/s)")
                last_report = now
        wrong = [rid for rid, (prompt, params) in expected.items()
                 if answered[rid] != standin_continuation(prompt, params.seed, params.max_tokens)]
        elapsed = time.monotonic() - start
        print(f"{requests} requests, {tokens} tokens in {elapsed:.2f} s "
              f"({requests / elapsed:,.0f} req/s); wrong outputs: {len(wrong)}")
        return 1 if wrong else 0
