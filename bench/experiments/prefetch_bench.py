"""Can an L2 prefetch hide a decode GEMM's weight stream behind kernels that leave HBM idle? An experiment, not a
kernel of the step (docs/benchmarks/experiments.md has the verdict: in the model step it did not pay).

Between a decode step's GEMMs run kernels that barely touch memory (RoPE, attention over a short context, the
split-KV combine, RMSNorm). The idea: fork a side branch before such a window that prefetches the next GEMM's weight
into L2, join it before the GEMM. Here the window is a sleep kernel of ``gap`` µs (``torch.cuda._sleep``: no memory
traffic), then ``F.linear`` (cuBLAS) at M rows, for Llama-3-8B's qkv and o_proj shapes. Three ways to prefetch
(``METHODS``): Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2``, one instruction per 16 KiB), one
``prefetch.global.L2::evict_last`` per 128-byte line, and plain loads (``evict_last``) whose values are dropped.
Per call: (window + GEMM) minus (window alone), with no prefetch, with the whole weight prefetched, and "warm": the
weight read by a GEMM just before the window (what L2 residency can give at best). ``CALLS`` calls per graph, each
on its own weight copy. The floor is the weight bytes at the measured copy rate. Every prefetched call's output must
equal the plain one bit for bit.

Run: ``PYTHONPATH=src python3 -m bench.experiments.prefetch_bench [--out prefetch_bench.json]`` (``$OUT/...`` when
set).
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.gpu_timing import graph_ms, kernel_bench_start

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096)}
ROWS = (1, 16)
GAPS_US = (10, 20)
CALLS = 8
CHUNK = 16384  # bytes per program lane
LANES = 32  # lanes per program: one warp


@triton.jit
def _bulk_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)  # <= 0 past the end: no prefetch
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    for line in range(0, CHUNK, 128):
        left = (nbytes - offs - line).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + offs + line, left], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _load_kernel(ptr, sink_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    total = tl.reduce(acc, 0, _xor)
    tl.store(sink_ptr, total, mask=total == 0x5EED1234)  # (almost) never true: keeps the loads alive


def prefetch(method: str, w: torch.Tensor, sink: torch.Tensor) -> None:
    nbytes = w.numel() * w.element_size()
    if method == "loads":
        block, iters = 1024, 16
        _load_kernel[(triton.cdiv(nbytes // 4, block * iters),)](w.view(-1).view(torch.int32), sink, nbytes // 4,
                                                                 BLOCK=block, ITERS=iters, num_warps=4)
        return
    kernel = {"bulk": _bulk_prefetch_kernel, "lines": _line_prefetch_kernel}[method]
    kernel[(triton.cdiv(nbytes, CHUNK * LANES),)](w.data_ptr(), nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)


METHODS = ("bulk", "lines", "loads")


def cycles_per_us() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per microsecond, from timing a long sleep."""
    cycles = 10_000_000
    return cycles / (graph_ms(lambda: torch.cuda._sleep(cycles), 5) * 1e3)


def calls(x, weights, gap_cycles: int, mode: str, side, sink, outs: list | None):
    """Per weight: [warm GEMM], window ∥ [prefetch], then the GEMM (into ``outs``; none when ``outs`` is None)."""
    main = torch.cuda.current_stream()
    for i, w in enumerate(weights):
        if mode == "warm":
            F.linear(x, w)
        if mode in METHODS:  # fork the prefetch beside the window, join it before the GEMM
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(mode, w, sink)
        torch.cuda._sleep(gap_cycles)
        if mode in METHODS:
            main.wait_stream(side)
        if outs is not None:
            outs[i] = F.linear(x, w)


def main():
    args, bw, _ = kernel_bench_start(__doc__, "prefetch_bench.json", reps=20, sweep=False)
    per_us = cycles_per_us()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    side, sink = torch.cuda.Stream(), torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, L2 {l2 / 2 ** 20:.0f} MiB, "
          f"{per_us:.0f} sleep cycles/us; {CALLS} weight copies per graph", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        floor_us = n * k * 2 / bw * 1e6
        for m, gap in ((m, gap) for m in ROWS for gap in GAPS_US):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = [F.linear(x, w) for w in weights]
            cycles = int(gap * per_us)
            for mode in ("none", *METHODS, "warm"):
                window_us = graph_ms(lambda: calls(x, weights, cycles, mode, side, sink, None),
                                     args.reps) * 1e3 / CALLS
                outs = [None] * CALLS
                us = graph_ms(lambda: calls(x, weights, cycles, mode, side, sink, outs), args.reps) * 1e3 / CALLS
                if any(not torch.equal(o, w) for o, w in zip(outs, want)):
                    raise SystemExit(f"{name} m={m} gap={gap} {mode}: the GEMM's output differs")
                gemm_us = us - window_us
                rows.append(dict(shape=name, n=n, k=k, m=m, gap_us=gap, mode=mode, window_us=window_us,
                                 call_us=us, gemm_us=gemm_us, floor_us=floor_us))
                print(f"{name:>7} m={m:2d} gap {gap:2d} us {mode:>5}: GEMM {gemm_us:6.2f} us  floor {floor_us:6.2f}"
                      f"  x{gemm_us / floor_us:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                       l2_bytes=l2, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
