"""Can a Triton kernel stream decode-sized weight GEMMs at cuBLAS's rate on the H200? An experiment, not a kernel of
the step: the fused decode kernels issue 4 needs (input RMSNorm into the qkv GEMM, SiLU-mul into the down GEMM) are
only worth writing if their GEMM part keeps up with cuBLAS, which runs the big decode GEMMs at 1.01-1.05x the weight
bytes' floor but the small ones (qkv, o_proj) at 1.34-1.39x (profile of 01bbbfc, docs/benchmarks/models.md).

For Llama-3-8B's four weight shapes (qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336) at
M = 1, 4 and 16 rows: ``torch.nn.functional.linear`` (cuBLAS) against ``skinny_linear`` at every launch shape of
``SWEEP`` (output rows per program, K per iteration, split-K ways, warps, stages), each first checked against
float64. Times are medians of CUDA-event-timed graph replays of ``CALLS`` back-to-back calls, each on its own copy of
the weight (as a step's layers read different weights: one copy would be served from L2), per call; the floor is
the weight bytes at the measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.gemv_bench [--out gemv_bench.json]`` (``$OUT/...`` when ``$OUT``
is set).
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16)
CALLS = 8
SWEEP = [dict(block_n=n, block_k=k, split_k=s, num_warps=4, num_stages=st) for n, k, s, st in
         itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (3, 4))]


@triton.jit(do_not_specialize=["m"])  # one compile per launch shape for every M
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """``out[:m, tile] (+)= x[:m, part] @ w[tile, part].T`` for output tile ``program_id(0)`` and K part
    ``program_id(1)`` (float32 atomics when split)."""
    tile, part = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    per_part = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(part * per_part, tl.minimum(k, (part + 1) * per_part), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :],
                    mask=(cols[:, None] < n) & (ks[None, :] < k), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    out = out_ptr + rows[:, None] * n + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, split_k: int,
                  num_warps: int, num_stages: int) -> torch.Tensor:
    """``x [m, K]`` bf16 (m <= 16) @ ``w [N, K]``.T into float32 ``out [m, N]`` (zeroed here when split)."""
    m, k = x.shape
    n = w.shape[0]
    if split_k > 1:
        out.zero_()
    _skinny_linear_kernel[(triton.cdiv(n, block_n), split_k)](x, w, out, m, n, k, BLOCK_M=16, BLOCK_N=block_n,
                                                             BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps,
                                                             num_stages=num_stages)
    return out


def bench_shape(name: str, n: int, k: int, bw: float, reps: int) -> list[dict]:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(CALLS)]
    floor_us = n * k * 2 / bw * 1e6
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ weights[0].double().T
        cublas_us = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], reps) * 1e3 / CALLS
        outs = [torch.empty(m, n, device="cuda", dtype=torch.float32) for _ in weights]
        results, best = sweep_timed(SWEEP, lambda shape: rel_err(skinny_linear(x, weights[0], outs[0], **shape), want),
                                    lambda shape, i: skinny_linear(x, weights[i], outs[i], **shape), CALLS, reps)
        rows.append(dict(shape=name, n=n, k=k, m=m, floor_us=floor_us, cublas_us=cublas_us, best=best,
                         sweep=results))
        print(f"{name:>8} m={m:2d}: floor {floor_us:7.2f} us  cuBLAS {cublas_us:7.2f} (x{cublas_us / floor_us:.2f})  "
              + (f"Triton best {best['us']:7.2f} (x{best['us'] / floor_us:.2f}) {best}" if best else "Triton: none"),
              flush=True)
        for r in results:
            if r["us"] is None:
                print(f"{'':>8}   {'does not fit' if r['error'] else 'WRONG'}: {r}", flush=True)
    return rows


def main():
    args, bw, _ = kernel_bench_start(__doc__, "gemv_bench.json", reps=20, sweep=False)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {CALLS} weight copies per graph", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += bench_shape(name, n, k, bw, args.reps)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw, rows=rows), f,
                  indent=2)
    wrong = [(r["shape"], r["m"]) for r in rows for x in r["sweep"] if x["error"] is None and not x["rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"skinny_linear differs from float64 at {sorted(set(wrong))} (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
