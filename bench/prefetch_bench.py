"""How much of a decode GEMM's weight stream can an L2 prefetch hide behind kernels that leave HBM idle?

``kernels/prefetch.py`` forks a side branch that bulk-prefetches a weight into L2 while the kernels before its GEMM
run (in the model: RoPE, attention, the split-KV combine before ``o_proj``). Here the window is a sleep kernel of
``gap`` µs (``torch.cuda._sleep``: no memory traffic), then ``F.linear`` (cuBLAS) at M rows, for Llama-3-8B's weight
shapes. Per call: (window + GEMM) minus the window alone, without prefetch and with the first ``frac`` of the
weight prefetched. ``CALLS`` calls per graph, each on its own weight copy (one copy would sit in L2 after the first
call). The floor is the weight bytes at the measured copy rate. Every prefetched call's output must equal the plain
one bit for bit.

Run: ``PYTHONPATH=src python3 bench/prefetch_bench.py [--out prefetch_bench.json]`` (``$OUT/...`` when set).
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from gpu_timing import graph_ms, kernel_bench_start

from blink.models.kernels.prefetch import l2_prefetch

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096)}
ROWS = (1, 16)
GAPS_US = (10, 20)
FRACS = (0.0, 1.0, -1.0)  # -1: warm, the weight read by a GEMM before the window
CALLS = 8


def cycles_per_us() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per microsecond, from timing a long sleep."""
    cycles = 10_000_000
    ms = graph_ms(lambda: torch.cuda._sleep(cycles), 5)
    return cycles / (ms * 1e3)


def window(gap_cycles: int):
    if gap_cycles:
        torch.cuda._sleep(gap_cycles)


def calls(x, weights, gap_cycles: int, frac: float, outs: list, last: bool = True):
    for i, w in enumerate(weights):
        if frac < 0:
            F.linear(x, w)
        with l2_prefetch([w], int(max(frac, 0) * w.numel() * w.element_size())):
            window(gap_cycles)
        if last:
            outs[i] = F.linear(x, w)


def main():
    args, bw, _ = kernel_bench_start(__doc__, "prefetch_bench.json", reps=20, sweep=False)
    per_us = cycles_per_us()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, L2 {l2 / 2 ** 20:.0f} MiB, "
          f"{per_us:.0f} sleep cycles/us; {CALLS} weight copies per graph", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        floor_us = n * k * 2 / bw * 1e6
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = [F.linear(x, w) for w in weights]
            for gap in GAPS_US:
                cycles = int(gap * per_us)
                for frac in FRACS:
                    alone_us = graph_ms(lambda: calls(x, weights, cycles, frac, [], False), args.reps) * 1e3 / CALLS
                    outs = [None] * CALLS
                    us = graph_ms(lambda: calls(x, weights, cycles, frac, outs), args.reps) * 1e3 / CALLS
                    if any(not torch.equal(o, w) for o, w in zip(outs, want)):
                        raise SystemExit(f"{name} m={m} gap={gap} frac={frac}: output differs with the prefetch")
                    gemm_us = us - alone_us
                    rows.append(dict(shape=name, n=n, k=k, m=m, gap_us=gap, frac=frac, window_us=alone_us,
                                     call_us=us, gemm_us=gemm_us, floor_us=floor_us))
                    print(f"{name:>8} m={m:2d} gap {gap:2d} us (window {alone_us:6.2f}) prefetch {frac:3.1f}: "
                          f"GEMM {gemm_us:7.2f} us  floor {floor_us:6.2f}  x{gemm_us / floor_us:.2f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                       l2_bytes=l2, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
