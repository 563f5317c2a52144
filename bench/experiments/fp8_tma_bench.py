"""Does vLLM's FP8 decode GEMM shape, written in Triton, stream the weights faster than blink's? An experiment.

On one H100 (2026-12-06, Qwen3-8B shape, FP8 weights quantized at load, ctx 1K) vLLM 0.26's decode step ran its 144
projections in 2,692 / 2,791 us at B = 1 / 64 (``bench/peers/vllm_step.py --quantization fp8``) where blink's took
2,945 (``fp8_skinny``) / 3,115 (``fp8_gemm``). vLLM's kernel there is CUTLASS's ``KernelTmaWarpSpecialized
FP8FastAccum`` with A and B swapped: the weight rows are the MMA's M (64 a program), the tokens its N (16 up to 16
rows, 64 at 64), 256 columns per stage, TMA loads, no split. Here the same arrangement in Triton: both operands
e4m3 through host-built TMA descriptors (``TensorDescriptor``), ``tl.dot(w, a.T)`` into a float32 ``[BLOCK_N,
BLOCK_M]`` tile, per-token and per-row scales at the end, optionally the reduction split (``split_k``), swept over
tile sizes and pipeline depth, against blink's kernels at their default shapes on the same activations (quantized
per token, as vLLM's are; ``fp8_skinny`` takes them unquantized).

Each shape is first checked against float64 (the dequantized operands); times are medians of CUDA-event-timed graph
replays of ``CALLS`` back-to-back calls on ``CALLS`` weight copies, per call; the floor is the weight bytes at the
measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.fp8_tma_bench [--rows 1 16 64] [--shapes qkv ...] [--out
fp8_tma_bench.json]`` (``$OUT/...`` when set).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bench.experiments.fp8_gemv_bench import CALLS, projections
from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed
from blink.models.e4m3 import dequantize, quantize_rows
from blink.models.kernels.fp8 import fp8_gemm
from blink.models.kernels.fp8_skinny import skinny_fp8_linear
from blink.models.kernels.pdl import pdl_args, wait_for_previous
from blink.models.kernels.quantize import quantize_activations
from blink.models.kernels.split_k import split_buffers, store_split
from blink.models.kernels.tiles import check_tiles

ROWS = (1, 16, 64)
SWEEP = [dict(block_n=n, block_k=k, split_k=s, num_warps=4, num_stages=st) for n, k, s, st in
         itertools.product((64, 128), (128, 256), (1, 2, 4), (3, 4, 6, 8))]


@triton.jit
def _swap_ab_kernel(w_desc, a_desc, w_scale_ptr, a_scale_ptr, out_ptr, work_ptr, counter_ptr, m, n, k,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    PDL: tl.constexpr):
    """``out[m, n] = sum_k a[m, k] w[n, k] * a_scale[m] * w_scale[n]``, this program's ``BLOCK_N`` weight rows by
    ``BLOCK_M`` tokens over K part ``program_id(2)``; ``w`` and ``a`` e4m3 through TMA descriptors (rows past the
    end read as zero)."""
    pid_n, pid_m, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    per_part = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(part * per_part, tl.minimum(k, (part + 1) * per_part), BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k0])
        a = a_desc.load([pid_m * BLOCK_M, k0])
        acc = tl.dot(w, a.T, acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < n, rows < m
    acc *= (tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[:, None]
            * tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)[None, :])
    store_split(acc, out_ptr, work_ptr, counter_ptr + pid_m * tl.num_programs(0) + pid_n,
                rows.to(tl.int64)[None, :] * n + cols[:, None], col_ok[:, None] & row_ok[None, :], part, m * n,
                SPLIT_K)


@dataclass(frozen=True)
class SwapTiles:
    """``block_n`` weight rows (the MMA's M: 64 or 128) and ``block_k`` columns per stage, the reduction split
    ``split_k`` ways, warps, stages; the tokens' tile is the rows rounded up to a power of two of at least 16."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        check_tiles(self)


def swap_ab_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 tiles: SwapTiles) -> torch.Tensor:
    """e4m3 ``a [M, K]`` with float32 per-token ``a_scale`` times e4m3 ``weight [N, K]`` with per-row ``scale [N]``
    → bf16 ``[M, N]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = a.shape, weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, block_m), tiles.split_k)
    work, counters = split_buffers(out, weight, tiles.split_k, grid[0] * grid[1])
    w_desc = TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k])
    a_desc = TensorDescriptor.from_tensor(a, [block_m, tiles.block_k])
    _swap_ab_kernel[grid](w_desc, a_desc, scale, a_scale, out, work, counters, m, n, k, BLOCK_N=tiles.block_n,
                          BLOCK_M=block_m, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(a.device))
    return out


def bench(name: str, n: int, k: int, m: int, bw: float, reps: int) -> dict:
    quantized = [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)
                 for _ in range(CALLS)]
    floor_us = (n * k + n * 4) / bw * 1e6
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, a_scale = quantize_activations(x, k)
    want = (a.double() * a_scale.double()) @ dequantize(*quantized[0], None).double().T
    results, best = sweep_timed(
        SWEEP, lambda shape: rel_err(swap_ab_gemm(a, a_scale, *quantized[0], SwapTiles(**shape)), want),
        lambda shape, i: swap_ab_gemm(a, a_scale, *quantized[i], SwapTiles(**shape)), CALLS, reps)
    gemm_us = graph_ms(lambda: [fp8_gemm(a, a_scale, *q, None, torch.bfloat16) for q in quantized], reps) * 1e3 / CALLS
    skinny_us = (graph_ms(lambda: [skinny_fp8_linear(x, *q, None) for q in quantized], reps) * 1e3 / CALLS
                 if m <= 32 else None)
    print(f"{name:>8} m={m:2d}: floor {floor_us:6.2f} us  fp8_gemm {gemm_us:6.2f}  skinny "
          f"{skinny_us or float('nan'):6.2f}  swap-AB TMA best {best and round(best['us'], 2)} "
          f"{best and {key: best[key] for key in SwapTiles.__dataclass_fields__} }", flush=True)
    return dict(shape=name, n=n, k=k, m=m, floor_us=floor_us, fp8_gemm_us=gemm_us, skinny_us=skinny_us, best=best,
                sweep=results)


def main():
    shapes = projections("qwen3-8b")
    args, bw, _ = kernel_bench_start(__doc__, "fp8_tma_bench.json", reps=20, sweep=False, rows=list(ROWS),
                                     shapes=list(shapes))
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {CALLS} weight copies per graph", flush=True)
    rows = []
    for name in args.shapes:
        for m in args.rows:
            rows.append(bench(name, *shapes[name], m, bw, args.reps))
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # after each, so that a run cut short keeps what it measured
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                               rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
