"""Do Llama-3-8B's weight GEMMs at decode batches 64-256 (and a 2048-token prefill) leave speed on the table? An
experiment for issue 4: at batch 256 the step's GEMMs alone take ~7 ms (``gemms`` rows of ``bench/model_bench.py``)
against ~4.9 ms of matmul FLOPs at the measured bf16 rate, so cuBLAS runs them at ~1.4x their FLOP floor.

For each weight (qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head 128256x4096) and
M in ``ROWS``: ``torch.nn.functional.linear`` (cuBLAS) against a Triton matmul at every launch shape of ``SWEEP``
(tile M/N/K, warps, stages; output tiles in groups of ``GROUP_M`` rows of tiles for L2 reuse), each first checked
against cuBLAS (relative error < 1e-2). Times are medians of graph replays of ``CALLS`` calls, each on its own weight
copy, per call. The floor is max(weight bytes at the copy rate, FLOPs at the GEMM rate), both measured now.

Run: ``PYTHONPATH=src python3 -m bench.experiments.gemm_bench [--out gemm_bench.json]`` (``$OUT/...`` when ``$OUT``
is set).
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
ROWS = (64, 256, 2048)
CALLS = 4
GROUP_M = 8
SWEEP = [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s) for m, n, k, w, s in
         itertools.product((64, 128), (64, 128, 256), (64,), (4, 8), (3, 4))]


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, c_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``c[m, n] = a[m, k] @ w[n, k].T``, bf16 in and out, float32 accumulation; tile ``program_id(0)`` in grouped
    order (``GROUP_M`` rows of tiles share their weight tiles through L2)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + rows[:, None].to(tl.int64) * k + ks[None, :]
    w = w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        a_tile = tl.load(a, mask=(rows[:, None] < m) & (k0 + ks[None, :] < k), other=0.0)
        w_tile = tl.load(w, mask=(cols[:, None] < n) & (k0 + ks[None, :] < k), other=0.0)
        acc = tl.dot(a_tile, tl.trans(w_tile), acc)
        a += BLOCK_K
        w += BLOCK_K
    tl.store(c_ptr + rows[:, None].to(tl.int64) * n + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_m: int, block_n: int, block_k: int,
           num_warps: int, num_stages: int) -> torch.Tensor:
    m, k = a.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](a, w, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
                         num_warps=num_warps, num_stages=num_stages)
    return out


def bench_shape(name: str, n: int, k: int, bw: float, flops: float, reps: int) -> list[dict]:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(CALLS)]
    rows = []
    for m in (r for r in ROWS if name != "lm_head" or r <= 256):  # the step's LM head sees <= 256 rows
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        floor_us = max(n * k * 2 / bw, 2 * m * n * k / flops) * 1e6
        want = F.linear(a, weights[0])
        cublas_us = graph_ms(lambda: [F.linear(a, w) for w in weights], reps) * 1e3 / CALLS
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
        results, best = sweep_timed(SWEEP, lambda shape: rel_err(matmul(a, weights[0], outs[0], **shape), want),
                                    lambda shape, i: matmul(a, weights[i], outs[i], **shape), CALLS, reps)
        rows.append(dict(shape=name, n=n, k=k, m=m, floor_us=floor_us, cublas_us=cublas_us, best=best,
                         sweep=results))
        print(f"{name:>8} m={m:4d}: floor {floor_us:7.2f} us  cuBLAS {cublas_us:7.2f} (x{cublas_us / floor_us:.2f})  "
              + (f"Triton best {best['us']:7.2f} (x{best['us'] / floor_us:.2f}) "
                 f"{ {key: best[key] for key in SWEEP[0]} }" if best else "Triton: none"), flush=True)
        for r in results:
            if r["us"] is None and r["error"] is None:
                print(f"{'':>8}   WRONG: {r}", flush=True)
    return rows


def main():
    args, bw, flops = kernel_bench_start(__doc__, "gemm_bench.json", reps=20, sweep=False)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {flops / 1e12:.0f} TFLOP/s; "
          f"{CALLS} weight copies per graph", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += bench_shape(name, n, k, bw, flops, args.reps)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                       bf16_flop_per_s=flops, rows=rows), f, indent=2)
    wrong = [(r["shape"], r["m"]) for r in rows for x in r["sweep"] if x["error"] is None and not x["rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"the Triton matmul differs from cuBLAS at {sorted(set(wrong))} (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
