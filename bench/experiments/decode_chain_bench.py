"""Chained decode-sized GEMMs on the H200: does programmatic dependent launch (PDL) hide their ramp and tail, does
folding the RMSNorm before each GEMM into its operand loads remove the norm kernel's cost, and does a graph holding
PDL launches still instantiate for device launch? An experiment for issue 4, not a step kernel.

The B=1 decode step is ~400 dependent kernels: small GEMMs at 1.4-1.8x their weight bytes' floor, 65 RMSNorm and
32 SiLU-mul kernels of 1.5-2.4 us, ~160 us per step in gaps (profiles in docs/benchmarks/models.md). Here ``CALLS``
chained steps ``x_(i+1) = x_i @ W_i.T`` (square, each W its own copy, bf16 out), with the norm
``x_(i+1) = rms_norm(x_i) @ W_i.T``, or gated ``x_(i+1) = silu(x_0 @ W_i.T) * (x_0 @ U_i.T)`` (the MLP's gate_up
and SiLU-mul, each step from the first x as a chain of them decays to zero; its floor is twice the others'), are
captured in one CUDA graph and timed per step, as:

- ``cublas``: ``torch.nn.functional.linear``;
- ``triton``: the skinny GEMM kernel below, plain launches;
- ``pdl``: the same launched with PDL: each program waits (``gdc_wait``) only before it reads x, so the next GEMM's
  programs are placed while the previous one drains (``b1c020f`` also timed an L2 prefetch of each program's weight
  rows before the wait: slower, 15.5 us against 11.9 per 4096^2 call at M=1);
- ``norm+cublas`` / ``norm+triton``: blink's RMSNorm kernel, then cuBLAS (the step's unfused pair) / the skinny GEMM;
- ``fused-in`` / ``fused-pre`` / ``fused-post``: the skinny GEMM with the norm folded in: its weight folded into W's
  columns ahead of time, the per-row scale ``rsqrt(mean(x^2) + eps)`` applied to the accumulator, the squares
  summed from the x tiles the loop loads, in a pass over x before the loop, or after it; ``fused-in+pdl`` with PDL.
  Two versions that multiplied each loaded x tile by the norm weight before its ``tl.dot`` (squares summed before
  the loop / in it) took 23.1 / 30.8 us per 4096^2 call at M=1 against 14.6 for norm+triton;
- ``silu+cublas``: cuBLAS on the stacked [W; U], then blink's SiLU-mul kernel;
- ``gated`` / ``gated+pdl``: one skinny kernel with two weight streams and SiLU-mul in its epilogue.

Each variant is first checked against float64 (relative error < 1e-2). Then the ``pdl`` chain's raw graph is
instantiated with ``cudaGraphInstantiateFlagDeviceLaunch`` (as blink's step graphs are) and uploaded; the result
(ok or the CUDA error) is printed. Results of every variant: ``bench/results/decode_chain_bench_h200_a4e792e.json``
(table and reading in docs/benchmarks/experiments.md: no folded norm beats the norm kernel + GEMM; the gated
kernel gains 1-2 us a call); it names the earlier runs' files too, the first of them (PDL variants only) as
``bench/pdl_bench.py``.
Run: ``PYTHONPATH=src python3 -m bench.experiments.decode_chain_bench [--out decode_chain_bench.json]``
(``$OUT/...`` when ``$OUT`` is set).
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err
from blink.models.kernels.activation import silu_and_mul
from blink.models.kernels.norm import rms_norm

SIZES = (4096, 8192)
ROWS = (1, 16)
CALLS = 8
SHAPES = [dict(block_n=n, block_k=k, num_warps=4, num_stages=s) for n, k, s in
          itertools.product((32, 64), (128, 256), (3, 4))]
# variant -> (kernel's NORM mode, PDL); NORM: 0 none, 1 squares summed from the x tiles the loop loads anyway,
# 2 in a pass over x before the loop, 3 in a pass after it
FUSED = {"fused-in": (1, False), "fused-pre": (2, False), "fused-post": (3, False), "fused-in+pdl": (1, True)}
VARIANTS = ("triton", "pdl", "norm+cublas", "norm+triton", *FUSED, "silu+cublas", "gated", "gated+pdl")
EPS = 1e-5
NORM_BLOCK = 1024  # entries of x per step of a separate pass of squares (NORM 2 and 3)


@triton.jit
def _row_squares(x_ptr, rows, m, k, NORM_BLOCK: tl.constexpr):
    squares = tl.zeros(rows.shape, tl.float32)
    for k0 in range(0, k, NORM_BLOCK):
        ks = k0 + tl.arange(0, NORM_BLOCK)
        x = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    return squares


@triton.jit(do_not_specialize=["m"])
def _chain_linear_kernel(x_ptr, w_ptr, up_ptr, out_ptr, m, n, k, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
                         GATED: tl.constexpr):
    """``out[:m, tile] = x[:m] @ w[tile].T`` in bf16 for output tile ``program_id(0)``.

    ``NORM`` > 0: the RMSNorm of x before the GEMM, its weight already folded into ``w``'s columns by the caller,
    so only the per-row scale is left: ``rsqrt(mean(x^2) + eps) * (x @ w.T)``; x goes into the dot unchanged (an
    elementwise op between a loaded x tile and ``tl.dot`` costs a round trip through registers per K step).
    ``GATED``: SiLU-and-mul of two GEMMs, ``silu(x @ w.T) * (x @ up.T)``: the gate_up projection with the
    activation in its epilogue (two weight streams per program)."""
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_offsets = cols[:, None].to(tl.int64) * k
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    if NORM == 2:
        squares = _row_squares(x_ptr, rows, m, k, NORM_BLOCK)
    else:
        squares = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
        w_mask = (cols[:, None] < n) & (ks[None, :] < k)
        acc += tl.dot(a, tl.trans(tl.load(w_ptr + w_offsets + ks[None, :], mask=w_mask, other=0.0)))
        if GATED:
            acc_up += tl.dot(a, tl.trans(tl.load(up_ptr + w_offsets + ks[None, :], mask=w_mask, other=0.0)))
        if NORM == 1:
            af = a.to(tl.float32)
            squares += tl.sum(af * af, axis=1)
    if NORM == 3:
        squares = _row_squares(x_ptr, rows, m, k, NORM_BLOCK)
    if NORM > 0:
        acc *= tl.rsqrt(squares / k + eps)[:, None]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, shape: dict, pdl: bool = False,
                  norm: int = 0, up: torch.Tensor | None = None) -> None:
    """``out = x @ w.T`` in bf16, ``x`` at most 16 rows; ``norm``/``up`` as the kernel's ``NORM``/``GATED``."""
    n, k = w.shape
    _chain_linear_kernel[(triton.cdiv(n, shape["block_n"]),)](
        x, w, up if up is not None else w, out, x.shape[0], n, k, EPS, BLOCK_M=16, BLOCK_N=shape["block_n"],
        BLOCK_K=shape["block_k"], NORM_BLOCK=NORM_BLOCK, PDL=pdl, NORM=norm, GATED=up is not None,
        num_warps=shape["num_warps"], num_stages=shape["num_stages"], launch_pdl=pdl)


def chain(variant: str, xs: list[torch.Tensor], p: dict, shape: dict | None) -> None:
    """One step per weight: ``xs[i + 1] = xs[i] @ w[i].T``; the ``norm`` / ``fused`` variants normalise ``xs[i]``
    by ``norm_w[i]`` first (``fused``: folded into ``folded[i] = w[i] * norm_w[i]``). The gated variants compute
    ``xs[i + 1] = silu(xs[0] @ w[i].T) * (xs[0] @ up[i].T)``: each from the first x, since a chain of them decays
    to zero (``silu(g) * u`` is about ``g * u / 2`` for small values); stream order still serialises the steps."""
    for i, (x, out) in enumerate(zip(xs, xs[1:])):
        if variant.startswith("norm+"):
            x = rms_norm(x, p["norm_w"][i], EPS)[0]
        if variant in ("cublas", "norm+cublas"):
            torch.nn.functional.linear(x, p["w"][i], out=out)
        elif variant == "silu+cublas":
            silu_and_mul(torch.nn.functional.linear(xs[0], p["gate_up"][i]), out=out)
        elif variant in FUSED:
            norm, pdl = FUSED[variant]
            skinny_linear(x, p["folded"][i], out, shape, pdl=pdl, norm=norm)
        elif variant.startswith("gated"):
            skinny_linear(xs[0], p["w"][i], out, shape, pdl=variant.endswith("pdl"), up=p["up"][i])
        else:
            skinny_linear(x, p["w"][i], out, shape, pdl=variant == "pdl")


def reference_chain(variant: str, x: torch.Tensor, p: dict):
    """The last output of ``variant``'s chain, in float64."""
    if variant.startswith(("silu", "gated")):
        x = x.double()
        return torch.nn.functional.silu(x @ p["w"][-1].double().T) * (x @ p["up"][-1].double().T)
    want = x.double()
    for i, w in enumerate(p["w"]):
        if variant.startswith(("norm", "fused")):
            want = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + EPS) * p["norm_w"][i].double()
        want = want @ w.double().T
    return want


def device_launch_check(xs, p, shape) -> str:
    """Instantiates the ``pdl`` chain's graph for device launch, as blink does its step graphs."""
    from cuda.bindings import runtime

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        chain("pdl", xs, p, shape)
    flag = runtime.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    err, graph_exec = runtime.cudaGraphInstantiateWithFlags(
        runtime.cudaGraph_t(init_value=graph.raw_cuda_graph()), flag)
    if err != runtime.cudaError_t.cudaSuccess:
        return f"instantiate: {err.name}"
    err, = runtime.cudaGraphUpload(graph_exec, runtime.cudaStream_t(init_value=torch.cuda.current_stream().cuda_stream))
    return "ok" if err == runtime.cudaError_t.cudaSuccess else f"upload: {err.name}"


def matrices_per_step(variant: str) -> int:
    """Weight matrices per step of ``variant``: its floor in units of one matrix's bytes."""
    return 2 if variant.startswith(("silu", "gated")) else 1


def bench_size(size: int, m: int, bw: float, reps: int) -> dict:
    def matrices():
        return [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) * size ** -0.5 for _ in range(CALLS)]
    p = dict(w=matrices(), up=matrices(), norm_w=[torch.rand(size, device="cuda", dtype=torch.bfloat16) + 0.5
                                                 for _ in range(CALLS)])
    p["folded"] = [w * nw for w, nw in zip(p["w"], p["norm_w"])]
    p["gate_up"] = [torch.cat([w, up]) for w, up in zip(p["w"], p["up"])]
    xs = [torch.randn(m, size, device="cuda", dtype=torch.bfloat16)] + [
        torch.empty(m, size, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    floor_us = size * size * 2 / bw * 1e6
    cublas_us = graph_ms(lambda: chain("cublas", xs, p, None), reps) * 1e3 / CALLS
    row = dict(size=size, m=m, floor_us=floor_us, cublas_us=cublas_us,
               rel_err_cublas=rel_err(xs[-1], reference_chain("cublas", xs[0], p)), runs=[])
    for variant, shape in itertools.product(VARIANTS, SHAPES):
        try:
            chain(variant, xs, p, shape)
            err = rel_err(xs[-1], reference_chain(variant, xs[0], p))
            us = graph_ms(lambda: chain(variant, xs, p, shape), reps) * 1e3 / CALLS \
                if err < 1e-2 else None
            row["runs"].append(dict(variant=variant, **shape, rel_err=err, us=us, error=None))
        except Exception as e:  # an image without PDL support, or shared memory too small: reported, not fatal
            row["runs"].append(dict(variant=variant, **shape, rel_err=None, us=None,
                                    error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    best = {v: min((r for r in row["runs"] if r["variant"] == v and r["us"] is not None), key=lambda r: r["us"],
                   default=None) for v in VARIANTS}
    row["best"] = best
    print(f"size {size:5d} m={m:2d}: floor {floor_us:6.2f} us  cublas {cublas_us:6.2f} (x{cublas_us / floor_us:.2f})"
          + "".join(f"\n    {v:>13} " + (f"{b['us']:6.2f} (x{b['us'] / floor_us / matrices_per_step(v):.2f})" if b
                                           else "none") for v, b in best.items()), flush=True)
    for r in row["runs"]:
        if r["us"] is None:
            print(f"    {'WRONG' if r['error'] is None else 'failed'}: {r}", flush=True)
    if best["pdl"]:
        shape = {k: best["pdl"][k] for k in SHAPES[0]}
        row["device_launch"] = device_launch_check(xs, p, shape)
        print(f"    PDL chain graph instantiated for device launch: {row['device_launch']}", flush=True)
    return row


def main():
    args, bw, _ = kernel_bench_start(__doc__, "decode_chain_bench.json", reps=30, sweep=False)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, triton {triton.__version__}; "
          f"{CALLS} chained calls per graph", flush=True)
    rows = [bench_size(size, m, bw, args.reps) for size in SIZES for m in ROWS]
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       copy_bytes_per_s=bw, rows=rows), f, indent=2)
    wrong = [(r["size"], r["m"], x["variant"]) for r in rows for x in r["runs"]
             if x["error"] is None and not x["rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"the chain differs from float64 at {wrong} (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
