"""Does programmatic dependent launch (PDL) hide the ramp and tail of chained decode-sized GEMMs on the H200, and
does a graph holding PDL launches still instantiate for device launch? An experiment for issue 4, not a step kernel.

The B=1 decode step is ~400 dependent kernels; the profile of 01bbbfc (docs/benchmarks.md) puts the small GEMMs at
1.34-1.76x their weight bytes' floor and ~180 us per step in gaps, although each kernel's weight reads do not
depend on the previous kernel. Here ``CALLS`` chained ``x_{i+1} = x_i @ W_i.T`` (square, each W its own copy, bf16
out) are captured in one CUDA graph and timed per call, as:

- ``cublas``: ``torch.nn.functional.linear``;
- ``triton``: the skinny GEMM kernel below, plain launches;
- ``pdl``: the same launched with PDL: each program waits (``gdc_wait``) only before it reads x, so the next GEMM's
  programs are placed while the previous one drains;
- ``pdl+prefetch``: as ``pdl``, and before waiting each program prefetches its weight rows into L2
  (``prefetch.global.L2``), so weight streaming starts under the previous kernel's tail.

Each variant is first checked against float64 (relative error < 1e-2). Then the ``pdl`` chain's raw graph is
instantiated with ``cudaGraphInstantiateFlagDeviceLaunch`` (as blink's step graphs are) and uploaded; the result
(ok or the CUDA error) is printed.
Run: ``PYTHONPATH=src python3 bench/pdl_bench.py [--out pdl_bench.json]`` (``$OUT/...`` when ``$OUT`` is set).
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl
from gpu_timing import graph_ms, kernel_bench_start, rel_err

SIZES = (4096, 8192)
ROWS = (1, 16)
CALLS = 8
SHAPES = [dict(block_n=n, block_k=k, num_warps=4, num_stages=s) for n, k, s in
          itertools.product((32, 64), (128, 256), (3, 4))]
VARIANTS = ("triton", "pdl", "pdl+prefetch")


@triton.jit(do_not_specialize=["m"])
def _chain_linear_kernel(x_ptr, w_ptr, out_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """``out[:m, tile] = x[:m] @ w[tile].T`` in bf16 for output tile ``program_id(0)``."""
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < k), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def chain(variant: str, xs: list[torch.Tensor], weights: list[torch.Tensor], shape: dict | None) -> None:
    """``xs[i + 1] = xs[i] @ weights[i].T`` for every weight."""
    for x, w, out in zip(xs, weights, xs[1:]):
        if variant == "cublas":
            torch.nn.functional.linear(x, w, out=out)
            continue
        n, k = w.shape
        pdl = variant != "triton"
        _chain_linear_kernel[(triton.cdiv(n, shape["block_n"]),)](
            x, w, out, x.shape[0], n, k, BLOCK_M=16, BLOCK_N=shape["block_n"], BLOCK_K=shape["block_k"], PDL=pdl,
            PREFETCH=variant == "pdl+prefetch", num_warps=shape["num_warps"], num_stages=shape["num_stages"],
            launch_pdl=pdl)


def device_launch_check(xs, weights, shape) -> str:
    """Instantiates the ``pdl`` chain's graph for device launch, as blink does its step graphs."""
    from cuda.bindings import runtime

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        chain("pdl", xs, weights, shape)
    flag = runtime.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    err, graph_exec = runtime.cudaGraphInstantiateWithFlags(
        runtime.cudaGraph_t(init_value=graph.raw_cuda_graph()), flag)
    if err != runtime.cudaError_t.cudaSuccess:
        return f"instantiate: {err.name}"
    err, = runtime.cudaGraphUpload(graph_exec, runtime.cudaStream_t(init_value=torch.cuda.current_stream().cuda_stream))
    return "ok" if err == runtime.cudaError_t.cudaSuccess else f"upload: {err.name}"


def bench_size(size: int, m: int, bw: float, reps: int) -> dict:
    weights = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) * size ** -0.5 for _ in range(CALLS)]
    xs = [torch.randn(m, size, device="cuda", dtype=torch.bfloat16)] + [
        torch.empty(m, size, device="cuda", dtype=torch.bfloat16) for _ in weights]
    want = xs[0].double()
    for w in weights:
        want = want @ w.double().T
    floor_us = size * size * 2 / bw * 1e6
    cublas_us = graph_ms(lambda: chain("cublas", xs, weights, None), reps) * 1e3 / CALLS
    row = dict(size=size, m=m, floor_us=floor_us, cublas_us=cublas_us, rel_err_cublas=rel_err(xs[-1], want), runs=[])
    for variant, shape in itertools.product(VARIANTS, SHAPES):
        try:
            chain(variant, xs, weights, shape)
            err = rel_err(xs[-1], want)
            us = graph_ms(lambda: chain(variant, xs, weights, shape), reps) * 1e3 / CALLS if err < 1e-2 else None
            row["runs"].append(dict(variant=variant, **shape, rel_err=err, us=us, error=None))
        except Exception as e:  # an image without PDL support, or shared memory too small: reported, not fatal
            row["runs"].append(dict(variant=variant, **shape, rel_err=None, us=None,
                                    error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    best = {v: min((r for r in row["runs"] if r["variant"] == v and r["us"] is not None), key=lambda r: r["us"],
                   default=None) for v in VARIANTS}
    row["best"] = best
    print(f"size {size:5d} m={m:2d}: floor {floor_us:6.2f} us  cuBLAS {cublas_us:6.2f} (x{cublas_us / floor_us:.2f})"
          + "".join(f"  {v} " + (f"{b['us']:6.2f} (x{b['us'] / floor_us:.2f})" if b else "none")
                    for v, b in best.items()), flush=True)
    for r in row["runs"]:
        if r["us"] is None:
            print(f"    {'WRONG' if r['error'] is None else 'failed'}: {r}", flush=True)
    if best["pdl"]:
        shape = {k: best["pdl"][k] for k in SHAPES[0]}
        row["device_launch"] = device_launch_check(xs, weights, shape)
        print(f"    PDL chain graph instantiated for device launch: {row['device_launch']}", flush=True)
    return row


def main():
    args, bw, _ = kernel_bench_start(__doc__, "pdl_bench.json", reps=30, sweep=False)
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
