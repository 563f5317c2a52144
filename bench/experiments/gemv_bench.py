"""Which GEMM should a model-dtype projection of a decode-sized step take: cuBLAS or the skinny Triton GEMM
(``blink.models.kernels.skinny.skinny_linear``, what ``kernels/linear.py`` dispatches to up to ``SKINNY_UP_TO``
rows)? An experiment that sets that rule and the skinny GEMM's launch shapes, not a kernel of its own.

For each model of ``--cases`` (``blink.bench.shapes``; default Qwen3-0.6B, Llama-3.2-1B, Qwen3-8B) and each of its four
projections (qkv, o_proj, gate_up, down) at M = 1, 16, 32 and 64 rows (``--rows``): ``torch.nn.functional.linear``
(cuBLAS), ``skinny_linear`` at its default launch shape (``skinny_tiles``) and, with ``--sweep``, at every launch
shape of ``SWEEP`` (``WIDE_SWEEP`` beyond 16 rows), each first checked against float64. Times are medians of
CUDA-event-timed graph replays of ``CALLS`` back-to-back calls, each on its own copy of the weight (as a step's layers
read different weights: one copy would be served from L2), per call; the floor is the weight bytes at the measured
copy rate. Back-to-back calls of one kernel do not show PDL's overlap, which the step's chain adds for the skinny GEMM.

Run: ``PYTHONPATH=src:. python3 -m bench.experiments.gemv_bench [--sweep] [--out gemv_bench.json]`` (``$OUT/...`` when
``$OUT`` is set); ``bash bench/gpu_suite.sh experiment:gemv_bench``.
"""
from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.experiments.fp8_gemv_bench import WIDE_SWEEP, projections
from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed
from blink.models.kernels.skinny import SkinnyTiles, skinny_linear, skinny_tiles

CALLS = 8
# Up to 16 rows: a weight row's 128-256 bytes per iteration, 4 or 8 warps (64 x 128 bf16 tiles at 4 warps left a
# stack frame on sm_90 with Triton 3.9).
SWEEP = [dict(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=3) for n, k, s, w in
         itertools.product((32, 64, 128), (64, 128), (1, 2, 4), (4, 8))]
MODELS = ["qwen3-0.6b", "llama-3.2-1b", "qwen3-8b"]
ROWS = [1, 16, 32, 64]


def bench_shape(model: str, name: str, n: int, k: int, bw: float, args) -> list[dict]:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(CALLS)]
    floor_us = n * k * 2 / bw * 1e6
    rows = []
    for m in args.rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ weights[0].double().T
        cublas_us = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], args.reps) * 1e3 / CALLS
        default_err = rel_err(skinny_linear(x, weights[0]), want)
        default_us = graph_ms(lambda: [skinny_linear(x, w) for w in weights], args.reps) * 1e3 / CALLS
        results, best = [], None
        if args.sweep:
            results, best = sweep_timed(
                SWEEP if m <= 16 else WIDE_SWEEP,
                lambda shape: rel_err(skinny_linear(x, weights[0], tiles=SkinnyTiles(**shape)), want),
                lambda shape, i: skinny_linear(x, weights[i], tiles=SkinnyTiles(**shape)), CALLS, args.reps)
        rows.append(dict(model=model, shape=name, n=n, k=k, m=m, floor_us=floor_us, cublas_us=cublas_us,
                         default_tiles=vars(skinny_tiles(m, n, k, None, 2)), default_us=default_us,
                         default_rel_err=default_err, best=best, sweep=results))
        print(f"{model:>12} {name:>8} {n:6d}x{k:<6d} m={m:2d}: floor {floor_us:6.2f} us  cuBLAS {cublas_us:6.2f} "
              f"(x{cublas_us / floor_us:.2f})  skinny {default_us:6.2f} (x{default_us / floor_us:.2f})"
              + (f"  best {best['us']:6.2f} {({key: best[key] for key in SkinnyTiles.__dataclass_fields__})}"
                 if best else ""), flush=True)
    return rows


def main():
    args, bw, _ = kernel_bench_start(__doc__, "gemv_bench.json", reps=20, cases=MODELS, rows=ROWS)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {CALLS} weight copies per graph", flush=True)
    rows = []
    for model in args.cases:
        for name, (n, k) in projections(model).items():
            rows += bench_shape(model, name, n, k, bw, args)
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # after each shape, so that a run cut short keeps what it measured
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                               rows=rows), f, indent=2)
    wrong = [(r["model"], r["shape"], r["m"]) for r in rows if not r["default_rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"skinny_linear differs from float64 at {wrong} (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
