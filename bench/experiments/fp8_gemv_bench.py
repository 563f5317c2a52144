"""Does the FP8 decode GEMM stream its weights near the HBM floor? The launch shapes of ``skinny_linear``
(``blink.models.kernels.skinny``: e4m3 weights upcast in registers, activations as they are) against bf16 cuBLAS and
against ``torch._scaled_mm`` with per-token activation quantization (the large-M path of ``fp8_linear``), on the
Qwen3-8B shape's four projections at M = 1, 16 and 32, per-row scales and 128x128 block scales (``--cases row block``;
``--shapes`` some of the four). At M = 64, 128 and 256, the GEMMs of quantized activations: the launch shapes of the
Triton ``fp8_gemm`` against ``_scaled_mm`` (per-row scales) and bf16 cuBLAS, the whole ``fp8_linear`` as it dispatches,
and the quantization kernel against the torch ops it replaced (``e4m3.quantize_activations``). ``--rows`` runs some of
the M.

Each launch shape is first checked against float64 (dequantized weights); times are medians of CUDA-event-timed
graph replays of ``CALLS`` back-to-back calls, each on its own weight copy (a step's layers read different weights),
per call; the floor is the FP8 weight bytes (one per weight, scales beside) at the measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.fp8_gemv_bench [--out fp8_gemv_bench.json]`` (``$OUT/...`` when
``$OUT`` is set); ``bash bench/gpu_suite.sh experiment:fp8_gemv_bench``.
"""
from __future__ import annotations

import itertools
import json

import torch

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed
from blink.models import e4m3
from blink.models.kernels.fp8 import Tiles, fp8_gemm, fp8_linear, scaled_mm
from blink.models.kernels.skinny import SkinnyTiles, skinny_linear
from blink.models.kernels.quantize import quantize_activations
from blink.models.e4m3 import FP8_MAX, dequantize, quantize_blocks, quantize_rows
from blink.bench.shapes import shape_config

CALLS = 8
ROWS = (1, 16, 32)
LARGE_ROWS = (64, 128, 256)
BLOCK = (128, 128)
SWEEP = [dict(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=st) for n, k, s, w, st in
         itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), (4,), (3, 4, 6))]
# Beyond 16 rows: wider weight tiles (each re-reads the activations' tile) and 8 warps for the larger accumulator.
WIDE_SWEEP = [dict(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=st) for n, k, s, w, st in
              itertools.product((64, 128, 256), (64, 128), (1, 2, 4), (4, 8), (3,))]
# Every program of a GEMM reads its rows' activations over its part of the reduction: wider weight tiles in more parts
# read them fewer times (at 64 rows, 32-output tiles read 2 bytes of activations from L2 per weight byte).
GEMM_SWEEP = [dict(block_m=bm, block_n=n, block_k=128, split_k=s, num_warps=w, num_stages=st) for bm, n, s, w, st in
              itertools.product((64, 128), (32, 64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4))]


def projections(name: str) -> dict[str, tuple[int, int]]:
    c = shape_config(name)
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def bench_shape(name: str, n: int, k: int, block, bw: float, reps: int, wanted: list[int]) -> list[dict]:
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(CALLS)]
    quantized = [quantize_rows(w) if block is None else quantize_blocks(w, block) for w in bf16]
    floor_us = (n * k + quantized[0][1].numel() * 4) / bw * 1e6
    rows = []
    for m in (m for m in ROWS if m in wanted):
        sweep = [s for s in (SWEEP if m <= 16 else WIDE_SWEEP)
                 if block is None or (block[1] % s["block_k"] == 0 and block[0] % s["block_n"] == 0)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight, scale = quantized[0]
        want = x.double() @ dequantize(weight, scale, block).double().T
        cublas_us = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in bf16], reps) * 1e3 / CALLS
        scaled_us = None
        if block is None:
            def quantized_mm(i):
                a, a_scale = quantize_activations(x, k)
                return scaled_mm(a, a_scale, *quantized[i], torch.bfloat16)
            scaled_us = graph_ms(lambda: [quantized_mm(i) for i in range(CALLS)], reps) * 1e3 / CALLS
        results, best = sweep_timed(
            sweep, lambda shape: rel_err(skinny_linear(x, weight, scale, block, SkinnyTiles(**shape)), want),
            lambda shape, i: skinny_linear(x, *quantized[i], block, SkinnyTiles(**shape)), CALLS, reps)
        default_us = graph_ms(lambda: [skinny_linear(x, *q, block) for q in quantized], reps) * 1e3 / CALLS
        rows.append(dict(shape=name, n=n, k=k, m=m, block=block, floor_us=floor_us, cublas_bf16_us=cublas_us,
                         scaled_mm_us=scaled_us, default_us=default_us, best=best, sweep=results))
        print(f"{name:>8} {'row' if block is None else 'block'} m={m:2d}: floor {floor_us:6.2f} us  bf16 cuBLAS "
              f"{cublas_us:6.2f}  scaled_mm {scaled_us or float('nan'):6.2f}  default {default_us:6.2f} "
              f"(x{default_us / floor_us:.2f})  best {best['us']:6.2f} (x{best['us'] / floor_us:.2f}) "
              f"{ {key: best[key] for key in SkinnyTiles.__dataclass_fields__} }", flush=True)
    return rows + [bench_large(name, n, k, m, block, quantized, bf16, floor_us, reps) for m in LARGE_ROWS
                   if m in wanted]


def bench_large(name: str, n: int, k: int, m: int, block, quantized, bf16, floor_us: float, reps: int) -> dict:
    """``m`` rows through quantized activations: the launch shapes of ``fp8_gemm`` (the GEMM alone) against
    ``_scaled_mm`` and bf16 cuBLAS, the whole ``fp8_linear``, and the activations' quantization alone, by its kernel
    and by the torch ops."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    group = k if block is None else block[1]
    a, a_scale = quantize_activations(x, group)
    # The GEMMs' own error: against the quantized activations (the quantization's own is ~3e-2).
    want = (a.double() * a_scale.double().repeat_interleave(group, -1)) @ dequantize(*quantized[0], block).double().T
    err = rel_err(fp8_linear(x, *quantized[0], block), want)
    cublas_us = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in bf16], reps) * 1e3 / CALLS
    scaled_us = None if block is not None else graph_ms(
        lambda: [scaled_mm(a, a_scale, *q, torch.bfloat16) for q in quantized], reps) * 1e3 / CALLS
    sweep = [s for s in GEMM_SWEEP if s["block_m"] <= max(64, m) and (block is None or block[0] % s["block_n"] == 0)]
    results, best = sweep_timed(
        sweep, lambda shape: rel_err(fp8_gemm(a, a_scale, *quantized[0], block, torch.bfloat16, Tiles(**shape)), want),
        lambda shape, i: fp8_gemm(a, a_scale, *quantized[i], block, torch.bfloat16, Tiles(**shape)), CALLS, reps)
    fp8_us = graph_ms(lambda: [fp8_linear(x, *q, block) for q in quantized], reps) * 1e3 / CALLS
    kernel_us = graph_ms(lambda: [quantize_activations(x, group) for _ in range(CALLS)], reps) * 1e3 / CALLS
    torch_us = graph_ms(lambda: [e4m3.quantize_activations(x, group) for _ in range(CALLS)], reps) * 1e3 / CALLS
    print(f"{name:>8} {'row' if block is None else 'block'} m={m}: floor {floor_us:6.2f} us  bf16 cuBLAS "
          f"{cublas_us:6.2f}  scaled_mm {scaled_us or float('nan'):6.2f}  fp8_gemm best "
          f"{best and {key: best[key] for key in ('us', *Tiles.__dataclass_fields__)} }  fp8_linear {fp8_us:6.2f} "
          f"(rel err {err:.1e})  quantize {kernel_us:5.2f} (torch ops {torch_us:5.2f})", flush=True)
    return dict(shape=name, n=n, k=k, m=m, block=block, floor_us=floor_us, cublas_bf16_us=cublas_us,
                scaled_mm_us=scaled_us, gemm_best=best, gemm_sweep=results, fp8_linear_us=fp8_us, rel_err=err,
                quantize_us=kernel_us, quantize_torch_us=torch_us)


def main():
    args, bw, _ = kernel_bench_start(__doc__, "fp8_gemv_bench.json", reps=20, sweep=False, cases=["row", "block"],
                                     rows=sorted({*ROWS, *LARGE_ROWS}), shapes=list(projections("qwen3-8b")))
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {CALLS} weight copies per graph; "
          f"e4m3 max {FP8_MAX}", flush=True)
    rows = []
    for block in [None if case == "row" else BLOCK for case in args.cases]:
        for name, (n, k) in projections("qwen3-8b").items():
            if name not in args.shapes:
                continue
            rows += bench_shape(name, n, k, block, bw, args.reps, args.rows)
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # after each shape, so that a run cut short keeps what it measured
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                               rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
