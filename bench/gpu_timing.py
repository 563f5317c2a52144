"""GPU timing and the rates floors are measured against, shared by the benchmarks in ``bench/``.

Times are medians of CUDA-event-timed calls (``events_median_ms``), or of replays of a CUDA graph captured after one
eager call that compiles the kernels (``graph_ms``); floors use the copy and GEMM rates measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch


def events_median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def replay_power(fn, step_ms: float, seconds: float = 3.0) -> dict | None:
    """Board power (NVML) while ``fn`` (one step's worth of GPU work, ``step_ms`` long) runs back to back for about
    ``seconds``, after a third of that unmetered so that NVML's averaged reading has settled; the GPU never waits for
    the host (batches of ~50 ms are queued one ahead). ``{"mean_power_w", "joules_per_step"}``, None without NVML."""
    from blink.bench.energy import EnergyMeter

    per_batch = max(1, int(50 / step_ms))
    batches = max(3, int(seconds * 1e3 / (per_batch * step_ms)))

    def run(n: int) -> None:
        previous = None
        for _ in range(n):
            for _ in range(per_batch):
                fn()
            queued = torch.cuda.Event()
            queued.record()
            if previous is not None:
                previous.synchronize()
            previous = queued
        previous.synchronize()

    run(batches // 3)
    with EnergyMeter() as meter:
        run(batches)
    energy = meter.result(batches * per_batch)
    if not energy["available"]:
        return None
    return {"mean_power_w": energy["mean_power_w"], "joules_per_step": energy["energy_j"] / (batches * per_batch)}


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting read + write."""
    x = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ms = events_median_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() / (ms / 1e3)


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 GEMM on random data."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    ms = events_median_ms(lambda: a @ b, 20)
    return 2 * 8192 ** 3 / (ms / 1e3)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one eager call that compiles its kernels."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn, reps: int) -> float:
    """Median time of ``fn`` captured in a CUDA graph (after one eager call that compiles its kernels)."""
    return events_median_ms(capture_graph(fn).replay, reps)


def kernel_times(run) -> dict[str, tuple[int, float]]:
    """Kernel name -> (launches, GPU µs) while ``run()`` runs: CUPTI, which traces the kernels a graph launches too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return {e.key: (e.count, e.device_time_total) for e in prof.key_averages()
            if (getattr(e, "device_time_total", 0) or 0) > 0}


def step_profile(kernels: list[dict], step_ms: float, top: int = 15) -> dict:
    """A step's ``kernels`` (``{"kernel", "per_step", "us_per_step"}``) heaviest first, printed, with how much of the
    step's ``step_ms`` they keep the GPU busy (the rest: launch gaps, dependencies, the host)."""
    kernels = sorted(kernels, key=lambda k: -k["us_per_step"])
    busy_ms = sum(k["us_per_step"] for k in kernels) / 1e3
    print(f"    kernels busy {busy_ms:.3f} of {step_ms:.3f} ms per step ({len(kernels)} kernel kinds)", flush=True)
    for k in kernels[:top]:
        print(f"    {k['us_per_step']:9.1f} us  x{k['per_step']:5.0f}  {k['kernel'][:90]}", flush=True)
    if len(kernels) > top:  # the JSON lists every kind
        rest = sum(k["us_per_step"] for k in kernels[top:])
        print(f"    {rest:9.1f} us  in the other {len(kernels) - top} kinds", flush=True)
    return dict(step_ms=step_ms, busy_ms=busy_ms, kernels=kernels)


def kernel_profile(graph, step_ms: float, steps: int = 10, top: int = 15) -> dict:
    """GPU time per kernel over ``steps`` replays of a captured step, per step: where a step's time goes
    (``step_profile``)."""
    def replays():
        for _ in range(steps):
            graph.replay()

    kernels = [dict(kernel=name, per_step=count / steps, us_per_step=us / steps)
               for name, (count, us) in kernel_times(replays).items()]
    return step_profile(kernels, step_ms, top)


def kernel_bench_start(doc: str, json_name: str, reps: int, sweep: bool = True, cases: list[str] | None = None,
                       profile: bool = False, rows: list[int] | None = None,
                       shapes: list[str] | None = None) -> tuple[argparse.Namespace, float, float]:
    """The command line shared by the kernel benches (``--out``, ``--reps``, ``--sweep`` where the sweep is optional,
    ``--cases`` to run some of ``cases``, ``--profile SIZE ...`` where the bench can break sizes down per kernel,
    ``--rows`` to run some of ``rows``, ``--shapes`` some of ``shapes``), then the copy and GEMM rates their floors
    use, measured now: (args, bytes/s, FLOP/s)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), json_name))
    parser.add_argument("--reps", type=int, default=reps)
    if sweep:
        parser.add_argument("--sweep", action="store_true", help="also time every launch shape of the sweep")
    if profile:
        parser.add_argument("--profile", nargs="+", type=int, default=[], metavar="SIZE",
                            help="also break these sizes down per kernel (CUPTI), after every timing: graph replays "
                                 "after a profile in the same process run slower")
    if cases:
        parser.add_argument("--cases", nargs="+", default=cases, choices=cases, help="the cases to run (all)")
    if rows:
        parser.add_argument("--rows", nargs="+", type=int, default=rows, choices=rows, help="the rows to run (all)")
    if shapes:
        parser.add_argument("--shapes", nargs="+", default=shapes, choices=shapes, help="the shapes to run (all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    bw, flops = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    return args, bw, flops


def sweep_timed(sweep: list[dict], check, call, calls: int, reps: int) -> tuple[list[dict], dict | None]:
    """Every launch shape of ``sweep``: ``check(shape)`` returns its relative error against the reference (a shape
    that does not fit the SM is recorded with the error instead); a correct one (< 1e-2) is then timed as ``calls``
    launches ``call(shape, i)`` captured in one graph, µs per launch. Returns (the results, the fastest correct one,
    or None)."""
    from triton.runtime.errors import OutOfResources

    results = []
    for shape in sweep:
        try:
            err = check(shape)
        except OutOfResources as e:
            results.append(dict(**shape, rel_err=None, us=None, error=str(e).splitlines()[0]))
            continue
        us = graph_ms(lambda: [call(shape, i) for i in range(calls)], reps) * 1e3 / calls if err < 1e-2 else None
        results.append(dict(**shape, rel_err=err, us=us, error=None))
    timed = sorted((r for r in results if r["us"] is not None), key=lambda r: r["us"])
    return results, timed[0] if timed else None
