"""Weights copied into shared memory before the PDL wait: does a decode GEMV's ramp hide under the kernel before it?
An experiment for issue 43, whose kernel became the step's one-row GEMV (``blink.models.kernels.gemv``).

A small model's batch-1 step is ~250 dependent kernels, each a few µs of fixed cost; its 112 projections
(Qwen3-0.6B) take 668 µs on an H100 against ~300 µs of weight bytes. What a kernel launched with PDL does before
``griddepcontrol.wait`` overlaps the previous kernel's tail, and only weights may be read there. Asking L2 for them
there (``prefetch_bench``, ``decode_chain_bench``) or loading two weight tiles into registers
(``try/weight-preload``) made the step slower (docs/benchmarks/experiments.md); both leave the data where the loop's
pipelined copies do not look for it. Here ``kernels.gemv``'s Gluon GEMV streams its weight rows through a ring of
``STAGES`` shared-memory tiles by ``cp.async`` (Ampere's asynchronous copy) and issues the first ``STAGES`` copies
before or after the wait; optionally each program also lets its dependents launch as it starts
(``griddepcontrol.launch_dependents``), so the next GEMV's programs are placed, and copy, while this one runs.

The chain: ``LAYERS`` layers of Qwen3-0.6B's four projections at one row (qkv 1024 → 4096, o_proj 2048 → 1024,
gate_up 1024 → 6144, down 3072 → 1024; each input the previous output's first columns, so every GEMV depends on the
last), every weight its own copy (4.2 to 12.6 MB, 31.5 MB a layer: the chain's 252 MB do not stay in L2), captured in
one CUDA graph and timed per layer against its weight bytes at the measured copy rate. Variants:

- ``skinny``: blink's skinny GEMM (``skinny_linear``, PDL as in the step);
- ``gluon-after``: the Gluon GEMV, every copy after the wait;
- ``gluon-before``: its first ``STAGES`` copies before the wait;
- ``gluon-before+trigger``: and its dependents launched as each program starts.

Each is first checked against float64 (relative error < ``TOLERANCE``); a variant that fails to compile or launch is
reported, not fatal. Run: ``PYTHONPATH=src python3 -m bench.experiments.smem_prefetch_bench [--out FILE]``
(``$OUT/smem_prefetch_bench.json`` when ``$OUT`` is set).
"""
from __future__ import annotations

import json
import sys

import torch
import triton

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err
from blink.models.kernels.gemv import BLOCK_K, NUM_WARPS, STAGES, _gemv_kernel, block_n_for
from blink.models.kernels.skinny import skinny_linear

LAYERS = 8
TOLERANCE = 2e-2   # relative error of the chain's last output: 32 dependent GEMVs, each output rounded to bf16
# (outputs, inputs) of Qwen3-0.6B's projections, in the order a layer runs them.
PROJECTIONS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
VARIANTS = {"skinny": None, "gluon-after": (False, False), "gluon-before": (True, False),
            "gluon-before+trigger": (True, True)}


def gemv_variant(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, copy_before_wait: bool, trigger: bool) -> None:
    """``kernels.gemv``'s kernel with the variant's copies and trigger."""
    n, k = w.shape
    block_n = block_n_for(n)
    _gemv_kernel[(n // block_n,)](w, x, out, K=k, BLOCK_N=block_n, BLOCK_K=BLOCK_K, STAGES=STAGES,
                                  COPY_BEFORE_WAIT=copy_before_wait, TRIGGER=trigger, num_warps=NUM_WARPS,
                                  launch_pdl=True)


def chain(variant: str, x0: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor]) -> torch.Tensor:
    """Each projection of the chain reads the first columns of the one before (the first reads ``x0``); returns
    the last output. The Gluon GEMVs write ``outs``, the skinny GEMM its own outputs (a copy would be a launch)."""
    x = x0
    for w, out in zip(weights, outs):
        source = x[:, :w.shape[1]]
        if VARIANTS[variant] is None:
            x = skinny_linear(source, w)
        else:
            gemv_variant(source[0], w, out[0], *VARIANTS[variant])
            x = out
    return x


def reference(x0: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    x = x0.double()
    for w in weights:
        x = x[:, :w.shape[1]] @ w.double().T
    return x


def main() -> None:
    args, bw, _ = kernel_bench_start(__doc__, "smem_prefetch_bench.json", reps=50, sweep=False)
    shapes = [shape for _ in range(LAYERS) for shape in PROJECTIONS]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for n, k in shapes]
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes]
    x0 = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    floor_us = sum(w.numel() * w.element_size() for w in weights) / bw * 1e6 / LAYERS
    want = reference(x0, weights)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, triton {triton.__version__}; {LAYERS} layers "
          f"of Qwen3-0.6B's projections at one row; floor {floor_us:.2f} us a layer", flush=True)
    runs = []
    for variant in VARIANTS:
        try:
            err = rel_err(chain(variant, x0, weights, outs), want)
            timed = err < TOLERANCE
            us = graph_ms(lambda: chain(variant, x0, weights, outs), args.reps) * 1e3 / LAYERS if timed else None
            runs.append(dict(variant=variant, rel_err=err, us_per_layer=us, error=None))
        except Exception as e:  # noqa: BLE001 (a variant the image cannot compile or launch is reported)
            runs.append(dict(variant=variant, rel_err=None, us_per_layer=None,
                             error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        r = runs[-1]
        print(f"  {variant:>21} " + (f"{r['us_per_layer']:7.2f} us a layer (x{r['us_per_layer'] / floor_us:.2f})"
                                      if r["us_per_layer"] else f"rel_err {r['rel_err']} {r['error'] or 'WRONG'}"),
              flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       copy_bytes_per_s=bw, layers=LAYERS, projections=PROJECTIONS, block_k=BLOCK_K, stages=STAGES,
                       floor_us_per_layer=floor_us, runs=runs), f, indent=2)
    if any(r["error"] is None and not r["rel_err"] < TOLERANCE for r in runs):
        sys.exit(f"a variant differs from float64 (relative error >= {TOLERANCE})")


if __name__ == "__main__":
    main()
