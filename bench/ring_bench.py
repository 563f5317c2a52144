"""Ring protocol benchmark: agent submit/poll throughput and slot-find cost.

    PYTHONPATH=src python -m bench.ring_bench [--json out.json]

1. Cross-process throughput: the agent here, the reference consumer in another process over POSIX shared memory,
   4096 slots, 1-token requests (so the protocol, not generation, is measured), for a fixed number of requests.
2. Agent-side costs in one process: submit() per request, poll() with 4096 slots (one bulk read).
3. Slot-find cost at 4096 slots and 50% / 99% occupancy: the occupied slots are random (the worst case for the hinted
   scan) or the oldest ones (requests finishing in arrival order). Reports ns per claim+release and slots probed.
Medians of several repetitions are reported.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time

import numpy as np

from bench import tree_commit
from blink.nic.agent import Agent
from blink.nic.slots import SlotTracker
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.reference import standin_engine
from blink.ring.request import SamplingParams
from blink.ring.transport import LocalMemory

N_SLOTS = 4096
GEOMETRY = RingGeometry(n_slots=N_SLOTS, max_prompt_tokens=128, max_output_tokens=16)


def cross_process_throughput(n_requests: int) -> dict:
    with standin_engine(GEOMETRY, max_running=N_SLOTS) as (memory, _):
        agent = Agent(memory, GEOMETRY)
        prompt, params = list(range(16)), SamplingParams(max_tokens=1, seed=0)
        submitted = finished = polls = 0
        start = time.perf_counter()
        while finished < n_requests:
            while submitted < n_requests and agent.tracker.n_free:
                agent.submit(prompt, params)
                submitted += 1
            finished += sum(out.finished for out in agent.poll())
            polls += 1
        elapsed = time.perf_counter() - start
    return {"requests": n_requests, "seconds": elapsed, "requests_per_s": n_requests / elapsed, "polls": polls}


def agent_costs(repeats: int) -> dict:
    layout = RingLayout(GEOMETRY)
    with LocalMemory(layout.size) as memory:
        memory.write(0, layout.control_bytes())
        agent = Agent(memory, GEOMETRY)
        prompt, params = list(range(16)), SamplingParams(max_tokens=1, seed=0)
        submit_us = []
        for _ in range(N_SLOTS):
            t = time.perf_counter_ns()
            agent.submit(prompt, params)
            submit_us.append((time.perf_counter_ns() - t) / 1e3)
        poll_us = []
        for _ in range(repeats):
            t = time.perf_counter_ns()
            agent.poll()
            poll_us.append((time.perf_counter_ns() - t) / 1e3)
    return {"submit_us_median": statistics.median(submit_us), "poll_4096_slots_us_median": statistics.median(poll_us)}


def slot_find_cost(occupancy: float, pattern: str, claims: int, seed: int = 0) -> dict:
    """Keep the ring at ``occupancy``: each round releases one occupied slot and claims one."""
    rng = np.random.default_rng(seed)
    tracker = SlotTracker(N_SLOTS)
    held = [tracker.claim() for _ in range(int(N_SLOTS * occupancy))]
    if pattern == "random":
        rng.shuffle(held)
        victims = rng.integers(0, len(held), claims)
    else:
        held, victims = collections.deque(held), None
    tracker.probes = 0
    start = time.perf_counter_ns()
    for i in range(claims):
        if victims is None:
            slot = held.popleft()               # oldest first: requests finish in arrival order
        else:
            j = int(victims[i]) % len(held)     # any request may finish
            slot, held[j] = held[j], held[-1]
            held.pop()
        tracker.release(slot)
        held.append(tracker.claim())
    elapsed = time.perf_counter_ns() - start
    return {"occupancy": occupancy, "pattern": pattern, "ns_per_claim_release": elapsed / claims,
            "probes_per_claim": tracker.probes / claims}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="ring_bench.json")
    parser.add_argument("--commit", default=None, help="the measured tree's commit (default: $BLINK_COMMIT, else HEAD)")
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    throughput = [cross_process_throughput(args.requests) for _ in range(args.repeats)]
    costs = [agent_costs(200) for _ in range(args.repeats)]
    scans = []
    for occupancy in (0.5, 0.99):
        for pattern in ("fifo", "random"):
            runs = [slot_find_cost(occupancy, pattern, 100_000, seed) for seed in range(args.repeats)]
            scans.append({**runs[0], "ns_per_claim_release": statistics.median(r["ns_per_claim_release"] for r in runs),
                          "probes_per_claim": statistics.median(r["probes_per_claim"] for r in runs)})

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": tree_commit(args.commit),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}",
        "n_slots": N_SLOTS,
        "cross_process_requests_per_s_median": statistics.median(t["requests_per_s"] for t in throughput),
        "cross_process_runs": throughput,
        "submit_us_median": statistics.median(c["submit_us_median"] for c in costs),
        "poll_4096_slots_us_median": statistics.median(c["poll_4096_slots_us_median"] for c in costs),
        "slot_find": scans,
    }
    print(f"ring bench, {N_SLOTS} slots, {result['machine']}, commit {result['commit']}")
    print(f"  submit+poll across processes (1-token requests): {result['cross_process_requests_per_s_median']:,.0f} "
          f"req/s (median of {args.repeats} x {args.requests})")
    print(f"  submit(): {result['submit_us_median']:.1f} us   poll() over 4096 slots: "
          f"{result['poll_4096_slots_us_median']:.1f} us")
    print(f"  {'occupancy':>9} {'pattern':>8} {'ns/claim+release':>17} {'probes/claim':>13}")
    for s in scans:
        print(f"  {s['occupancy']:>9.0%} {s['pattern']:>8} {s['ns_per_claim_release']:>17.0f} "
              f"{s['probes_per_claim']:>13.2f}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
