"""Chained decode-sized GEMMs on the H200: does programmatic dependent launch (PDL) hide their ramp and tail, does
folding the RMSNorm before each GEMM into its operand loads remove the norm kernel's cost, and does a graph holding
PDL launches still instantiate for device launch? An experiment for issue 4, not a step kernel.

The B=1 decode step is ~400 dependent kernels: small GEMMs at 1.4-1.8x their weight bytes' floor, 65 RMSNorm and
32 SiLU-mul kernels of 1.5-2.4 us, ~160 us per step in gaps (profiles in docs/benchmarks.md). Here ``CALLS``
chained steps ``x_(i+1) = x_i @ W_i.T`` (square, each W its own copy, bf16 out), or with the norm
``x_(i+1) = rms_norm(x_i) @ W_i.T``, are captured in one CUDA graph and timed per step, as:

- ``cublas``: ``torch.nn.functional.linear``;
- ``triton``: the skinny GEMM kernel below, plain launches;
- ``pdl``: the same launched with PDL: each program waits (``gdc_wait``) only before it reads x, so the next GEMM's
  programs are placed while the previous one drains;
- ``pdl+prefetch``: as ``pdl``, and before waiting each program prefetches its weight rows into L2
  (``prefetch.global.L2``), so weight streaming starts under the previous kernel's tail;
- ``norm+cublas``: blink's RMSNorm kernel, then cuBLAS (the step's unfused pair);
- ``norm+triton``: blink's RMSNorm kernel, then the skinny GEMM;
- ``fused``: the skinny GEMM normalising x as it loads it (each program first sums the squares of its rows of x,
  ``k`` entries each, then streams the weights);
- ``fused+pdl``: as ``fused``, launched with PDL.

Each variant is first checked against float64 (relative error < 1e-2). Then the ``pdl`` chain's raw graph is
instantiated with ``cudaGraphInstantiateFlagDeviceLaunch`` (as blink's step graphs are) and uploaded; the result
(ok or the CUDA error) is printed. The first results (PDL variants only, as ``bench/pdl_bench.py``):
``bench/results/pdl_bench_h200_b1c020f.json``.
Run: ``PYTHONPATH=src python3 bench/decode_chain_bench.py [--out decode_chain_bench.json]`` (``$OUT/...`` when
``$OUT`` is set).
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl
from gpu_timing import graph_ms, kernel_bench_start, rel_err

from blink.models.kernels.norm import rms_norm

SIZES = (4096, 8192)
ROWS = (1, 16)
CALLS = 8
SHAPES = [dict(block_n=n, block_k=k, num_warps=4, num_stages=s) for n, k, s in
          itertools.product((32, 64), (128, 256), (3, 4))]
VARIANTS = ("triton", "pdl", "pdl+prefetch", "norm+cublas", "norm+triton", "fused", "fused+pdl")
EPS = 1e-5
NORM_BLOCK = 1024  # entries of x per step of the fused kernel's sum of squares


@triton.jit(do_not_specialize=["m"])
def _chain_linear_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, m, n, k, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                         NORM: tl.constexpr):
    """``out[:m, tile] = a[:m] @ w[tile].T`` in bf16 for output tile ``program_id(0)``; ``a`` is ``x``, or with
    ``NORM`` its RMSNorm by weight ``nw`` (rounded as ``reference.rms_norm``: the normalised value, then its product
    with the weight, to bf16)."""
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * k
    if PREFETCH:  # one 128-byte line per 64 bf16 of this program's weight rows
        for k0 in range(0, k, BLOCK_K):
            lines = w_rows + k0 + tl.arange(0, BLOCK_K // 64)[None, :] * 64
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                      is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k, NORM_BLOCK):
            ks = k0 + tl.arange(0, NORM_BLOCK)
            x = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                        other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(squares / k + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)
            normed = (a.to(tl.float32) * rstd[:, None]).to(a.dtype).to(tl.float32)
            a = (nw[None, :] * normed).to(a.dtype)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < k), other=0.0)
        acc += tl.dot(a, tl.trans(w))
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, shape: dict, pdl: bool = False,
                  prefetch: bool = False, norm_weight: torch.Tensor | None = None) -> None:
    """``out = x @ w.T`` (or ``rms_norm(x) @ w.T`` with ``norm_weight``), bf16, ``x`` at most 16 rows."""
    n, k = w.shape
    norm = norm_weight is not None
    _chain_linear_kernel[(triton.cdiv(n, shape["block_n"]),)](
        x, norm_weight if norm else x, w, out, x.shape[0], n, k, EPS, BLOCK_M=16, BLOCK_N=shape["block_n"],
        BLOCK_K=shape["block_k"], NORM_BLOCK=NORM_BLOCK, PDL=pdl, PREFETCH=prefetch, NORM=norm,
        num_warps=shape["num_warps"], num_stages=shape["num_stages"], launch_pdl=pdl)


def chain(variant: str, xs: list[torch.Tensor], weights: list[torch.Tensor], norm_weights: list[torch.Tensor],
          shape: dict | None) -> None:
    """``xs[i + 1] = xs[i] @ weights[i].T`` for every weight (the ``norm`` and ``fused`` variants normalise
    ``xs[i]`` by ``norm_weights[i]`` first)."""
    for x, w, nw, out in zip(xs, weights, norm_weights, xs[1:]):
        if variant.startswith("norm+"):
            x = rms_norm(x, nw, EPS)[0]
        if variant in ("cublas", "norm+cublas"):
            torch.nn.functional.linear(x, w, out=out)
        else:
            skinny_linear(x, w, out, shape, pdl="pdl" in variant,
                          prefetch=variant == "pdl+prefetch", norm_weight=nw if variant.startswith("fused") else None)


def reference_chain(variant: str, x: torch.Tensor, weights: list[torch.Tensor], norm_weights: list[torch.Tensor]):
    """The chain of ``variant`` in float64."""
    want = x.double()
    for w, nw in zip(weights, norm_weights):
        if "norm" in variant or variant.startswith("fused"):
            want = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
        want = want @ w.double().T
    return want


def device_launch_check(xs, weights, norm_weights, shape) -> str:
    """Instantiates the ``pdl`` chain's graph for device launch, as blink does its step graphs."""
    from cuda.bindings import runtime

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        chain("pdl", xs, weights, norm_weights, shape)
    flag = runtime.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    err, graph_exec = runtime.cudaGraphInstantiateWithFlags(
        runtime.cudaGraph_t(init_value=graph.raw_cuda_graph()), flag)
    if err != runtime.cudaError_t.cudaSuccess:
        return f"instantiate: {err.name}"
    err, = runtime.cudaGraphUpload(graph_exec, runtime.cudaStream_t(init_value=torch.cuda.current_stream().cuda_stream))
    return "ok" if err == runtime.cudaError_t.cudaSuccess else f"upload: {err.name}"


def bench_size(size: int, m: int, bw: float, reps: int) -> dict:
    weights = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) * size ** -0.5 for _ in range(CALLS)]
    norm_weights = [torch.rand(size, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(CALLS)]
    xs = [torch.randn(m, size, device="cuda", dtype=torch.bfloat16)] + [
        torch.empty(m, size, device="cuda", dtype=torch.bfloat16) for _ in weights]
    floor_us = size * size * 2 / bw * 1e6
    cublas_us = graph_ms(lambda: chain("cublas", xs, weights, norm_weights, None), reps) * 1e3 / CALLS
    row = dict(size=size, m=m, floor_us=floor_us, cublas_us=cublas_us,
               rel_err_cublas=rel_err(xs[-1], reference_chain("cublas", xs[0], weights, norm_weights)), runs=[])
    for variant, shape in itertools.product(VARIANTS, SHAPES):
        try:
            chain(variant, xs, weights, norm_weights, shape)
            err = rel_err(xs[-1], reference_chain(variant, xs[0], weights, norm_weights))
            us = graph_ms(lambda: chain(variant, xs, weights, norm_weights, shape), reps) * 1e3 / CALLS \
                if err < 1e-2 else None
            row["runs"].append(dict(variant=variant, **shape, rel_err=err, us=us, error=None))
        except Exception as e:  # an image without PDL support, or shared memory too small: reported, not fatal
            row["runs"].append(dict(variant=variant, **shape, rel_err=None, us=None,
                                    error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    best = {v: min((r for r in row["runs"] if r["variant"] == v and r["us"] is not None), key=lambda r: r["us"],
                   default=None) for v in VARIANTS}
    row["best"] = best
    print(f"size {size:5d} m={m:2d}: floor {floor_us:6.2f} us  cublas {cublas_us:6.2f} (x{cublas_us / floor_us:.2f})"
          + "".join(f"\n    {v:>13} " + (f"{b['us']:6.2f} (x{b['us'] / floor_us:.2f})" if b else "none")
                    for v, b in best.items()), flush=True)
    for r in row["runs"]:
        if r["us"] is None:
            print(f"    {'WRONG' if r['error'] is None else 'failed'}: {r}", flush=True)
    if best["pdl"]:
        shape = {k: best["pdl"][k] for k in SHAPES[0]}
        row["device_launch"] = device_launch_check(xs, weights, norm_weights, shape)
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
