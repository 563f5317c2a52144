"""GPU scheduler benchmark (H200): launch overhead per step, slot-scan cost, admission latency.

    NUMBA_ENABLE_CUDASIM=0 PYTHONPATH=src python -m bench.scheduler_bench --json scheduler_bench.json

1. Step time with the stand-in step (one small kernel + the "done" kernel), both launch modes, 1 and 64 decoding
   requests: (time between the first token and the last) / (steps in between), timed on the host over 2000 steps.
   Baseline: the host launching the same step graph back to back.
2. Iteration time at 4096 slots with nothing to run (idle_sleep_ns=0, so the loop spins), with the ring empty, half
   and fully occupied (FINISHED slots: scanned, never admitted), and with a backlog of 4095 queued READY requests
   that cannot be admitted (max_num_seqs=1 is taken). Each case runs twice: plain, and with the host bumping the
   ``submitted`` doorbell as fast as it can, so that every iteration scans all 4096 state words; the difference
   is the scan's cost.
3. READY-to-first-token latency: the loop idles; the host submits one request and spins on its n_generated word.
   Reported from before the agent's submit (which encodes the header in Python) and from its return (the slot is
   READY and the doorbell rung: the GPU's part), and the submit's own time. With the request side in host memory the
   spin also watches the slot's state, splitting the GPU's part at RUNNING (published beside the request's first
   step: collect, admit, plan, the launch) into READY -> RUNNING and RUNNING -> first token (the step, consume,
   publish). Then by phase: with an idle sleep of 1 ms the idle resident loop watches the doorbells and runs no
   iteration, so what its profile gains from before a submit to the first token is (nearly) that request's
   iterations: medians of their count and of each phase's microseconds, beside READY -> first token.
4. The prefix cache in use: step time of 64 decoding requests whose 240-token prompts share their first 224 tokens,
   with caching on (the table takes a generated page every 16 steps per request, about 4 per iteration) and off;
   READY-to-first-token of a 240-token prompt whose first 224 tokens are cached, and of one with nothing cached.
5. Ring placement: the step time of case 1 (fire-and-forget, 1 and 64 decoding requests, submitted at once) with the
   ring's request side in pinned host memory and in GPU memory (``request_side="device"``; this process writes it
   through ``ring_memory``), so both placements see the same arrivals and the phases compare.
6. Beside memory-copying hogs (4 per core, ``blink bench serve --hog-kind memory``'s), with this process at the
   agent's default priority (nice -10): READY-to-first-token (idle sleep 20 us) in both placements, before the hogs
   start and among them, and case 5's step times among them. It tells whether the host's memory traffic slows the
   GPU's side of the ring (its PCIe reads of requests and writes of tokens), which a serving run beside such hogs
   cannot tell apart from the agent's own slowdown.
Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np

from bench import tree_commit
from blink.device.config import MAX_IDLE_SLEEP_NS, SchedulerConfig
from blink.device.driver import check
from blink.device.image import link_image
from blink.device.runtime import GpuScheduler
from blink.device.state import PROFILE_PHASES, SETTLE_PHASES
from blink.device.step import StepBuffers, StepLayout
from blink.nic.agent import Agent
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import FINISHED, RUNNING, RingLayout
from blink.ring.request import SamplingParams
from blink.ring.split import REQUEST_SIDES
from blink.ring.transport import LocalMemory

GEOMETRY = RingGeometry(n_slots=4096, max_prompt_tokens=256, max_output_tokens=2048, max_stop_ids=0, logprobs=False)
BASE = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, page_size=16, num_pages=40_000,
                       max_model_len=2304, enable_prefix_caching=False)
SHARED = list(range(1000, 1224))        # 14 pages of prefix shared by the prefix cases' prompts


def prompt(shared: bool, k: int) -> list[int]:
    """A short prompt of its own, or 16 tokens of its own after SHARED."""
    return SHARED + [5000 + 16 * k + i for i in range(16)] if shared else [1, 2, 3]


class Rig:
    """A ring (its request side in host or GPU memory), the GPU scheduler (stand-in step) on it, and an in-process
    agent. ``view`` is the host mapping: the live ring with ``request_side="host"``, only its output side else."""

    def __init__(self, image: bytes, config: SchedulerConfig, request_side: str = "host"):
        page_size = config.page_size if config.enable_prefix_caching else 0
        geometry = RingGeometry(**{**GEOMETRY.__dict__, "prefix_page_size": page_size})
        self.layout = RingLayout(geometry)
        self.memory = LocalMemory(self.layout.size)
        self.memory.write(0, self.layout.control_bytes())
        self.view = self.layout.view(self.memory.buffer)
        self.step = StepBuffers(StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq), "cuda")
        self.scheduler = GpuScheduler(self.memory, geometry, config, self.step.layout,
                                      {k: t.data_ptr() for k, t in self.step.tensors().items()}, image=image,
                                      request_side=request_side)
        self.ring = self.scheduler.ring_memory
        self.agent = Agent(self.ring, geometry, liveness_timeout_s=60)

    def control(self, name: str) -> int:
        return control.read(self.ring)[name]

    def generated(self) -> np.ndarray:
        """Every slot's ``n_generated``, in one read of the status region wherever it lives."""
        raw = self.ring.read(self.layout.offset("status"), self.layout.status_dtype.itemsize)
        return np.frombuffer(raw, self.layout.status_dtype)[0]["n_generated"]

    def stop(self) -> dict:
        """End the loop; return its phase profile (us per iteration)."""
        self.scheduler.request_shutdown()
        self.scheduler.join(timeout_s=60)
        profile = self.scheduler.profile()
        self.scheduler.close()
        return profile


def step_time(image: bytes, mode: str, batch: int, threads: int = 256, steps: int = 2000, caching: bool = False,
              shared: bool = False, request_side: str = "host") -> dict:
    """Per-step time of ``batch`` decoding requests (2000 steps, timed on the host); prompts ``prompt(shared)``."""
    rig = Rig(image, SchedulerConfig(**{**BASE.__dict__, "launch_mode": mode, "block_threads": threads,
                                        "enable_prefix_caching": caching}), request_side)
    rig.scheduler.start()
    slots = [rig.agent._slot_of[rig.agent.submit(prompt(shared, k), SamplingParams(max_tokens=steps,
                                                                                   ignore_eos=True))]
             for k in range(batch)]
    while (rig.generated()[slots] < 2).any():
        pass
    t0, s0 = time.perf_counter(), rig.control("steps")
    clock = sm_clock_mhz()
    while rig.control("finished") < batch:
        pass
    t1, s1 = time.perf_counter(), rig.control("steps")
    return {"mode": mode, "batch": batch, "threads": threads, "caching": caching, "shared": shared,
            "request_side": request_side, "steps": s1 - s0, "sm_clock_mhz": clock,
            "us_per_step": (t1 - t0) / (s1 - s0) * 1e6,
            "cache": {k: rig.control(k) for k in ("prefix_hit_tokens", "cached_pages", "prefix_evictions")},
            "profile_us": rig.stop()}


def sm_clock_mhz() -> int | None:
    """The SM clock nvidia-smi reports right now (the loop keeps one block busy: the GPU may not boost)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def host_baseline(image: bytes, launches: int = 2000) -> dict:
    """The host launching the 1-row stand-in step graph back to back, then synchronizing."""
    from cuda.bindings import driver, runtime

    rig = Rig(image, BASE)
    graph = rig.scheduler.step_graphs[0]
    stream = runtime.cudaStream_t(init_value=int(rig.scheduler.stream))
    for _ in range(100):
        runtime.cudaGraphLaunch(graph, stream)
    driver.cuStreamSynchronize(rig.scheduler.stream)
    t0 = time.perf_counter()
    for _ in range(launches):
        runtime.cudaGraphLaunch(graph, stream)
    driver.cuStreamSynchronize(rig.scheduler.stream)
    us = (time.perf_counter() - t0) / launches * 1e6
    rig.scheduler.close()
    return {"us_per_step": us}


def idle_iteration(image: bytes, mode: str, case: str, scan: bool, seconds: float = 0.3) -> dict:
    config = SchedulerConfig(**{**BASE.__dict__, "launch_mode": mode, "idle_sleep_ns": 0,
                                "max_num_seqs": 1 if case == "ready_backlog" else BASE.max_num_seqs})
    rig = Rig(image, config)
    state = rig.view.status["state"]
    if case == "half_finished":
        state[::2] = FINISHED
    elif case == "all_finished":
        state[:] = FINISHED
    rig.scheduler.start()
    if case == "ready_backlog":
        rig.agent.submit([1], SamplingParams(max_tokens=2048, ignore_eos=True))
        while rig.control("running") < 1:
            pass
        for _ in range(GEOMETRY.n_slots - 1):
            rig.agent.submit([1], SamplingParams(max_tokens=1))
    time.sleep(0.05)
    doorbell = rig.view.control["submitted"]
    t0, h0 = time.perf_counter(), rig.control("heartbeat")
    while time.perf_counter() - t0 < seconds:
        if scan:
            doorbell += 1
    t1, h1 = time.perf_counter(), rig.control("heartbeat")
    if case != "ready_backlog":
        state[:] = 0
    return {"mode": mode, "case": case, "scan": scan, "iterations": h1 - h0,
            "us_per_iteration": (t1 - t0) / (h1 - h0) * 1e6, "profile_us": rig.stop()}


def admission_latency(image: bytes, idle_ns: int, trials: int = 200, caching: bool = False,
                      shared: bool = False, request_side: str = "host", phases: bool = False,
                      max_tokens: int = 1) -> dict:
    """READY -> first token of ``prompt(shared)`` prompts, one at a time (with caching, SHARED is cached after the
    first; submitting includes the agent's hashing of the prompt). With the request side in GPU memory the submit
    writes go there and each spin reads ``n_generated`` with a copy out of it, so that placement's numbers compare
    with themselves (quiet against hogs), not with the host placement's. ``phases``: also the loop's profile gained
    from before each submit to its first token, medians per trial under ``phases``: ``iterations``, µs in each phase
    (the rest of the total is the launch, the step, the waits and what no phase times); meaningful where the idle
    loop runs no iteration meanwhile (a long ``idle_ns``). A request of ``max_tokens=1`` ends with its first token,
    so the iteration that consumes it retires it (frees its pages) before it publishes the token; one of 2 goes on,
    as a served request does at its first token (its profile would count its next step too: ``phases`` wants 1)."""
    rig = Rig(image, SchedulerConfig(**{**BASE.__dict__, "idle_sleep_ns": idle_ns, "enable_prefix_caching": caching}),
              request_side)
    rig.scheduler.start()
    # The host's view of the status region is live only where the request side (status included) is host memory.
    live = rig.view.status["n_generated"]
    generated = (lambda: live) if request_side == "host" else rig.generated
    state = rig.view.status["state"] if request_side == "host" else None
    samples, ready, submits, admitted, gained = [], [], [], [], []
    us_per_cycle = 1e3 / rig.scheduler.clock_khz() if phases else None
    for k in range(trials):
        before = rig.scheduler.cycles() if phases else None
        t0 = time.perf_counter()
        slot = rig.agent._slot_of[rig.agent.submit(prompt(shared, k) if shared else [5, 6],
                                                   SamplingParams(max_tokens=max_tokens))]
        t1 = time.perf_counter()                # the slot is READY and the doorbell rung
        running = None
        while generated()[slot] < 1:
            if running is None and state is not None and state[slot] == RUNNING:
                running = time.perf_counter()
        t2 = time.perf_counter()
        if phases:
            after = rig.scheduler.cycles()
            gained.append({"iterations": after["iterations"] - before["iterations"],
                           **{phase: (after[phase] - before[phase]) * us_per_cycle for phase in PROFILE_PHASES}})
        samples.append((t2 - t0) * 1e6)
        ready.append((t2 - t1) * 1e6)
        submits.append((t1 - t0) * 1e6)
        if running is not None:
            admitted.append((running - t1) * 1e6)
        while rig.agent.in_flight:
            rig.agent.poll()
    hits = rig.control("prefix_hit_tokens")
    rig.stop()
    return {"idle_sleep_ns": idle_ns, "max_tokens": max_tokens, "caching": caching, "shared": shared,
            "request_side": request_side,
            "prefix_hit_tokens": hits, **percentiles("", samples), **percentiles("ready_", ready),
            **percentiles("submit_", submits), **(percentiles("running_", admitted) if admitted else {}),
            **({"phases": {name: statistics.median(g[name] for g in gained) for name in gained[0]}} if phases else {})}


def percentiles(prefix: str, samples: list[float]) -> dict:
    """``{prefix}median_us`` and ``{prefix}p99_us`` of ``samples`` (us)."""
    ordered = sorted(samples)
    return {f"{prefix}median_us": statistics.median(ordered),
            f"{prefix}p99_us": ordered[int(0.99 * (len(ordered) - 1))]}


def memory_hogs(image: bytes) -> dict:
    """Case 6: admission in both placements before and among memory-copying hogs, and the step times among them."""
    from blink.bench.interference import HOG_KINDS, interference
    from blink.bench.serve import HOG_SETTLE_S
    from blink.host.priority import set_priority

    achieved = set_priority("auto", "--agent-priority")
    quiet = [admission_latency(image, 20_000, request_side=side) for side in REQUEST_SIDES]
    hogs = 4 * len(os.sched_getaffinity(0))
    with interference(hogs, HOG_KINDS["memory"]):
        time.sleep(HOG_SETTLE_S)
        admission = [admission_latency(image, 20_000, request_side=side) for side in REQUEST_SIDES]
        step = [step_time(image, "fire_and_forget", batch, request_side=side) for side in REQUEST_SIDES
                for batch in (1, 64)]
    return {"hogs": hogs, "priority": achieved, "admission_quiet": quiet, "admission": admission, "step": step}


def kernel_resources(image: bytes) -> dict:
    from cuda.bindings import driver

    rig = Rig(image, BASE)
    result = {}
    for name in ("blink_scheduler_window", "blink_scheduler_tail"):
        function = check(driver.cuModuleGetFunction(rig.scheduler.module, name.encode()))
        attribute = driver.CUfunction_attribute
        result[name] = {key: int(driver.cuFuncGetAttribute(getattr(attribute, a), function)[1]) for key, a in
                        [("registers", "CU_FUNC_ATTRIBUTE_NUM_REGS"),
                         ("local_bytes", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES"),
                         ("shared_bytes", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")]}
    rig.scheduler.close()
    return result


def profile_text(profile: dict) -> str:
    """A phase profile (us per iteration) in the order the phases run: prepare's, then settle's (which the
    fire-and-forget loop runs beside the step: ``step_launch_to_done`` covers them), then the step's launch to done."""
    prepare = [k for k in PROFILE_PHASES if k not in SETTLE_PHASES]
    parts = [f"{name} {sum(profile[k] for k in phases):.2f} (" + " ".join(f"{k}={profile[k]:.2f}" for k in phases)
             + ")" for name, phases in (("prepare", prepare), ("settle", SETTLE_PHASES))]
    return " | ".join(parts + [f"step_launch_to_done={profile['step_launch_to_done']:.2f}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="scheduler_bench.json")
    parser.add_argument("--commit", default=None, help="the measured tree's commit (default: $BLINK_COMMIT, else HEAD)")
    parser.add_argument("--quick", action="store_true",
                        help="only what an A/B of the loop needs (about 10 s): case 1 in fire-and-forget, the idle "
                             "iteration with the ring empty, case 3; no prefix, placement or hog cases")
    args = parser.parse_args()
    modes = ("fire_and_forget",) if args.quick else ("fire_and_forget", "tail")
    t = time.perf_counter()
    image = link_image()
    link_s = time.perf_counter() - t
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": tree_commit(args.commit),
        "link_seconds": link_s,
        "resources": kernel_resources(image),
        "host_baseline": host_baseline(image),
        "step": [step_time(image, mode, batch) for mode in modes for batch in (1, 64)]
        + ([] if args.quick else [step_time(image, "fire_and_forget", 64, threads) for threads in (64, 128)]),
        "idle": [idle_iteration(image, mode, case, scan) for mode in modes
                 for case in ("all_free",) + (() if args.quick else ("half_finished", "all_finished", "ready_backlog"))
                 for scan in (False, True)],
        "admission": [admission_latency(image, ns) for ns in (0, 20_000)]
        + [admission_latency(image, 0, max_tokens=2)],
        "admission_phases": admission_latency(image, MAX_IDLE_SLEEP_NS, trials=100, phases=True),
    }
    if not args.quick:
        result["prefix"] = {"step": [step_time(image, "fire_and_forget", 64, caching=c, shared=True)
                                     for c in (True, False)],
                            "admission": [admission_latency(image, 0, caching=c, shared=True) for c in (True, False)]}
        result["placement"] = [step_time(image, "fire_and_forget", batch, request_side=side) for side in REQUEST_SIDES
                               for batch in (1, 64)]
        result["memory_hogs"] = memory_hogs(image)       # last: it leaves this process at nice -10
    print(f"scheduler bench, commit {result['commit']}, image linked in {link_s:.1f} s")
    print(f"  kernel resources: {json.dumps(result['resources'])}")
    print(f"  host back-to-back launches of the 1-row step graph: {result['host_baseline']['us_per_step']:.2f} us")
    print(f"  {'mode':>16} {'batch':>5} {'threads':>7} {'us/step':>8} {'SM MHz':>7}  profile (us per iteration)")
    for r in result["step"]:
        print(f"  {r['mode']:>16} {r['batch']:>5} {r['threads']:>7} {r['us_per_step']:>8.2f} "
              f"{r['sm_clock_mhz'] or '?':>7}  {profile_text(r['profile_us'])}")
    print(f"  {'mode':>16} {'ring (4096 slots)':>18} {'us/iteration':>13} {'with full scan':>15}")
    for plain, scanning in zip(result["idle"][::2], result["idle"][1::2]):
        print(f"  {plain['mode']:>16} {plain['case']:>18} {plain['us_per_iteration']:>13.2f} "
              f"{scanning['us_per_iteration']:>15.2f}  collect={scanning['profile_us']['collect']:.2f}")
    quiet = result["idle"][0]["profile_us"]
    print("  quiet iteration profile (us): " + profile_text(quiet))
    for r in result["admission"]:
        print(f"  submit -> first token (idle sleep {r['idle_sleep_ns']} ns, max_tokens {r['max_tokens']}): median "
              f"{r['median_us']:.1f} us, "
              f"p99 {r['p99_us']:.1f} us; READY -> first token (from submit's return) median "
              f"{r['ready_median_us']:.1f} us, p99 {r['ready_p99_us']:.1f} us (READY -> RUNNING median "
              f"{r.get('running_median_us', float('nan')):.1f} us); the agent's submit median "
              f"{r['submit_median_us']:.1f} us")
    phases = result["admission_phases"]["phases"]
    print(f"  READY -> first token by phase (idle sleep 1 ms, medians): "
          f"{result['admission_phases']['ready_median_us']:.1f} us, {phases['iterations']:.0f} iterations, "
          + " ".join(f"{p}={phases[p]:.2f}" for p in PROFILE_PHASES)
          + f" (phases {sum(phases[p] for p in PROFILE_PHASES):.1f} us)")
    if not args.quick:
        print_more(result)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


def print_more(result: dict) -> None:
    """The prefix, placement and hog cases' lines."""
    for r in result["prefix"]["step"]:
        print(f"  prefix caching {'on ' if r['caching'] else 'off'}: 64 decoding, {r['us_per_step']:.2f} us/step, "
              f"{json.dumps(r['cache'])}  {profile_text(r['profile_us'])}")
    for r in result["prefix"]["admission"]:
        print(f"  prefix caching {'on ' if r['caching'] else 'off'}: READY -> first token of a 240-token prompt "
              f"(224 shared): median {r['median_us']:.1f} us, p99 {r['p99_us']:.1f} us, "
              f"{r['prefix_hit_tokens']} tokens hit")
    for r in result["placement"]:
        print(f"  request side in {r['request_side']:>6} memory: {r['batch']:>2} decoding, {r['us_per_step']:.2f} "
              f"us/step  {profile_text(r['profile_us'])}")
    hogged = result["memory_hogs"]
    for quiet, among in zip(hogged["admission_quiet"], hogged["admission"]):
        print(f"  READY -> first token, request side in {quiet['request_side']:>6} memory: median / p99 "
              f"{quiet['median_us']:.1f} / {quiet['p99_us']:.1f} us quiet, {among['median_us']:.1f} / "
              f"{among['p99_us']:.1f} us beside {hogged['hogs']} memory hogs ({hogged['priority']})")
    for r in hogged["step"]:
        print(f"  beside the hogs, request side in {r['request_side']:>6} memory: {r['batch']:>2} decoding, "
              f"{r['us_per_step']:.2f} us/step")


if __name__ == "__main__":
    main()
