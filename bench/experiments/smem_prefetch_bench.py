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
one CUDA graph and timed per layer against its weight bytes at the measured copy rate, at each of ``--rows`` (1, 16,
64: a decode step's sequences). Variants at one row:

- ``skinny``: blink's skinny GEMM (``skinny_linear``, PDL as in the step);
- ``gluon-after``: the Gluon GEMV, every copy after the wait;
- ``gluon-before``: its first ``STAGES`` copies before the wait;
- ``gluon-before+trigger``: and its dependents launched as each program starts (``kernels.gemv`` as the step runs it);
- ``mma-before+trigger``: the tensor-core twin below, its rows padded to 16.

At 16 and 64 rows, ``linear`` (the step's path: the skinny GEMM up to 16 rows, the rowwise one beyond) against
``mma-after`` and ``mma-before+trigger``: a Gluon GEMM of the same plan on tensor cores (``mma.sync``, Ampere's MMA,
which Hopper runs), ``MMA_BLOCK_N`` weight rows a program streamed through ``MMA_STAGES`` stages of ``MMA_BLOCK_K``
columns (the first 1,024 columns in flight before the wait), each stage multiplied with the rows' activations loaded
straight into the MMA's operand layout.

Each is first checked against float64 (relative error < ``TOLERANCE``); a variant that fails to compile or launch is
reported, not fatal. Run: ``PYTHONPATH=src python3 -m bench.experiments.smem_prefetch_bench [--rows 1 16 64]
[--out FILE]`` (``$OUT/smem_prefetch_bench.json`` when ``$OUT`` is set).
"""
from __future__ import annotations

import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err
from blink.models.kernels.gemv import BLOCK_K, STAGES, _barrier, launch_gemv, refill_weight_ring, start_weight_ring
from blink.models.kernels.linear import linear
from blink.models.kernels.skinny import block_m_for, skinny_linear

LAYERS = 8
TOLERANCE = 2e-2   # relative error of the chain's last output: 32 dependent GEMVs, each output rounded to bf16
# (outputs, inputs) of Qwen3-0.6B's projections, in the order a layer runs them.
PROJECTIONS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
ROWS = [1, 16, 64]
MMA_BLOCK_N = 16        # 2 warps of 8 columns: 64-384 programs for Qwen3-0.6B's projections
MMA_BLOCK_K = 64
MMA_STAGES = 16         # 1,024 columns in flight: all of a K = 1024 projection before the wait
MMA_WARPS = 2


@gluon.jit
def _mma_kernel(w_ptr, x_ptr, y_ptr, M, x_stride, K: gl.constexpr, N: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, COPY_BEFORE_WAIT: gl.constexpr,
                TRIGGER: gl.constexpr, num_warps: gl.constexpr):
    """``y[:M, tile] = x[:M] @ w[tile].T`` (``x [M, K]`` rows ``x_stride`` apart, ``y [M, N]`` contiguous):
    ``_gemv_kernel``'s ring of weight tiles, each stage multiplied on tensor cores (``ldmatrix`` of the tile
    transposed, ``mma.sync`` m16n8k16)."""
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    ring, tiles = start_weight_ring(w_ptr, K, BLOCK_N, BLOCK_K, STAGES, COPY_BEFORE_WAIT, TRIGGER, copy_layout,
                                    gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    x_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
    x_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
    x_tiles = x_ptr + x_rows[:, None] * x_stride + x_cols[None, :]
    x_ok = (x_rows < M)[:, None]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for i in range(K // BLOCK_K):
        a = gl.load(x_tiles + i * BLOCK_K, mask=x_ok, other=0.0)
        async_copy.wait_group(STAGES - 1)
        _barrier()
        acc = mma_v2(a, ring.index(i % STAGES).permute((1, 0)).load(b_layout), acc)
        _barrier()
        refill_weight_ring(ring, tiles, i, K, BLOCK_K, STAGES)
    out_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    out_cols = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(y_ptr + out_rows[:, None] * N + out_cols[None, :], acc.to(gl.bfloat16), mask=(out_rows < M)[:, None])


def mma_variant(x: torch.Tensor, w: torch.Tensor, copy_before_wait: bool, trigger: bool) -> torch.Tensor:
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _mma_kernel[(n // MMA_BLOCK_N,)](w, x, out, m, x.stride(0), K=k, N=n, BLOCK_M=block_m_for(m),
                                     BLOCK_N=MMA_BLOCK_N, BLOCK_K=MMA_BLOCK_K, STAGES=MMA_STAGES,
                                     COPY_BEFORE_WAIT=copy_before_wait, TRIGGER=trigger, num_warps=MMA_WARPS,
                                     launch_pdl=True)
    return out


# variant -> (the rows it runs at, projection: x [rows, K] with unit column stride, weight -> output)
VARIANTS = {
    "skinny": ((1,), skinny_linear),
    "gluon-after": ((1,), lambda x, w: launch_gemv(x, w, False, False)),
    "gluon-before": ((1,), lambda x, w: launch_gemv(x, w, True, False)),
    "gluon-before+trigger": ((1,), launch_gemv),
    "linear": ((16, 64), linear),
    "mma-after": ((16, 64), lambda x, w: mma_variant(x, w, False, False)),
    "mma-before+trigger": ((1, 16, 64), lambda x, w: mma_variant(x, w, True, True)),
}


def chain(project, x0: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Each projection of the chain reads the first columns of the one before (the first reads ``x0``): a view,
    as a step's activations may be, so that no copy kernel breaks the PDL chain; returns the last output."""
    x = x0
    for w in weights:
        x = project(x[:, :w.shape[1]], w)
    return x


def reference(x0: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    x = x0.double()
    for w in weights:
        x = x[:, :w.shape[1]] @ w.double().T
    return x


def main() -> None:
    args, bw, _ = kernel_bench_start(__doc__, "smem_prefetch_bench.json", reps=50, sweep=False, rows=ROWS)
    shapes = [shape for _ in range(LAYERS) for shape in PROJECTIONS]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for n, k in shapes]
    floor_us = sum(w.numel() * w.element_size() for w in weights) / bw * 1e6 / LAYERS
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, triton {triton.__version__}; {LAYERS} layers "
          f"of Qwen3-0.6B's projections; floor {floor_us:.2f} us a layer", flush=True)
    runs = []
    for rows in args.rows:
        x0 = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        want = reference(x0, weights)
        for variant, (at_rows, project) in VARIANTS.items():
            if rows not in at_rows:
                continue
            try:
                err = rel_err(chain(project, x0, weights), want)
                timed = err < TOLERANCE
                us = graph_ms(lambda: chain(project, x0, weights), args.reps) * 1e3 / LAYERS if timed else None
                runs.append(dict(rows=rows, variant=variant, rel_err=err, us_per_layer=us, error=None))
            except Exception as e:  # noqa: BLE001 (a variant the image cannot compile or launch is reported)
                runs.append(dict(rows=rows, variant=variant, rel_err=None, us_per_layer=None,
                                 error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            r = runs[-1]
            print(f"  {rows:>3} rows {variant:>21} "
                  + (f"{r['us_per_layer']:7.2f} us a layer (x{r['us_per_layer'] / floor_us:.2f})"
                     if r["us_per_layer"] else f"rel_err {r['rel_err']} {r['error'] or 'WRONG'}"), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       copy_bytes_per_s=bw, layers=LAYERS, projections=PROJECTIONS, block_k=BLOCK_K, stages=STAGES,
                       mma=dict(block_n=MMA_BLOCK_N, block_k=MMA_BLOCK_K, stages=MMA_STAGES, warps=MMA_WARPS),
                       floor_us_per_layer=floor_us, runs=runs), f, indent=2)
    if any(r["error"] is None and not r["rel_err"] < TOLERANCE for r in runs):
        sys.exit(f"a variant differs from float64 (relative error >= {TOLERANCE})")


if __name__ == "__main__":
    main()
