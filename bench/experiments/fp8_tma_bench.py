"""Does vLLM's FP8 decode GEMM shape, written in Triton, stream the weights faster than blink's other kernels?

On one H100 (2026-12-06, Qwen3-8B shape, FP8 weights quantized at load, ctx 1K) vLLM 0.26's decode step ran its 144
projections in 2,692 / 2,791 us at B = 1 / 64 (``bench/peers/vllm_step.py --quantization fp8``) where blink's took
2,945 (``skinny``) / 3,115 (``fp8_gemm``). vLLM's kernel there is CUTLASS's ``KernelTmaWarpSpecialized
FP8FastAccum`` with A and B swapped: the weight rows are the MMA's M (64 a program), the tokens its N (16 up to 16
rows, 64 at 64), 256 columns per stage, TMA loads, no split. The same arrangement in Triton is
``blink.models.kernels.rowwise``; here it is swept over tile sizes and pipeline depth, against blink's other
kernels at their default shapes on the same activations (quantized per token, as vLLM's are; ``skinny`` takes
them unquantized). The first run (``bench/results/fp8_tma_bench_h100_10f76d4.json``) also split the reduction 2 and 4
ways (the parts summed in the kernel, ``split_k``): never faster by more than 0.1 us than unsplit 6 stages deep.

Each shape is first checked against float64 (the dequantized operands); times are medians of CUDA-event-timed graph
replays of ``CALLS`` back-to-back calls on ``CALLS`` weight copies, per call; the floor is the weight bytes at the
measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.fp8_tma_bench [--rows 1 16 64] [--shapes qkv ...] [--out
fp8_tma_bench.json]`` (in the directory ``OUT`` names, when set).
"""
from __future__ import annotations

import itertools
import json

import torch

from bench.experiments.fp8_gemv_bench import CALLS, projections
from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed
from blink.models.e4m3 import dequantize, quantize_rows
from blink.models.kernels.fp8 import fp8_gemm
from blink.models.kernels.skinny import skinny_linear
from blink.models.kernels.rowwise import RowwiseTiles, rowwise_fp8_gemm
from blink.models.kernels.quantize import quantize_activations

ROWS = (1, 16, 64)
SWEEP = [dict(block_n=n, block_k=k, num_warps=4, num_stages=st) for n, k, st in
         itertools.product((64, 128), (128, 256), (3, 4, 6, 8))]


def bench(name: str, n: int, k: int, m: int, bw: float, reps: int) -> dict:
    quantized = [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)
                 for _ in range(CALLS)]
    floor_us = (n * k + n * 4) / bw * 1e6
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, a_scale = quantize_activations(x, k)
    want = (a.double() * a_scale.double()) @ dequantize(*quantized[0], None).double().T
    results, best = sweep_timed(
        SWEEP, lambda shape: rel_err(rowwise(a, a_scale, *quantized[0], RowwiseTiles(**shape)), want),
        lambda shape, i: rowwise(a, a_scale, *quantized[i], RowwiseTiles(**shape)), CALLS, reps)
    default_us = graph_ms(lambda: [rowwise(a, a_scale, *q) for q in quantized], reps) * 1e3 / CALLS
    gemm_us = graph_ms(lambda: [fp8_gemm(a, a_scale, *q, None, torch.bfloat16) for q in quantized], reps) * 1e3 / CALLS
    skinny_us = (graph_ms(lambda: [skinny_linear(x, *q, None) for q in quantized], reps) * 1e3 / CALLS
                 if m <= 32 else None)
    print(f"{name:>8} m={m:2d}: floor {floor_us:6.2f} us  fp8_gemm {gemm_us:6.2f}  skinny "
          f"{skinny_us or float('nan'):6.2f}  rowwise {default_us:6.2f}, best {best and round(best['us'], 2)} "
          f"{best and {key: best[key] for key in RowwiseTiles.__dataclass_fields__} }", flush=True)
    return dict(shape=name, n=n, k=k, m=m, floor_us=floor_us, fp8_gemm_us=gemm_us, skinny_us=skinny_us,
                rowwise_us=default_us, best=best, sweep=results)


def rowwise(a, a_scale, weight, scale, tiles=None):
    return rowwise_fp8_gemm(a, a_scale.reshape(-1), weight, scale, torch.bfloat16, tiles)


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
