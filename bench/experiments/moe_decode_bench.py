"""Can a GEMV-shaped MoE beat the fused grouped GEMM at decode sizes? An experiment, not a kernel of the step.

At one token the fused MoE (``blink.models.kernels.moe``) takes ~35 us per Qwen3-30B-A3B layer against ~18 us of
expert bytes, and its tile sweep found no launch shape below ~34 us: its grouped GEMM pads each expert's single row to
a 16-row block, sorts the entries with an alignment kernel first, and gives the first GEMM fewer programs than SMs.
The variant here has no alignment and no padding: one program per (entry, output tile), where an entry is one
(token, chosen expert); it multiplies the token's row by that expert's weight tile on the CUDA cores
(``tl.sum`` of products, no ``tl.dot``), with the first GEMM's SiLU-and-mul and the second's routing weight fused,
and the same combine kernel as the fused MoE. Each entry reads its expert's weights itself, so at more tokens an
expert chosen twice is read twice (from L2 if it is still there): the point is where it stops paying.

For tokens 1, 2, 4 and 8 (random router logits, near-uniform routing): the fused MoE at its default tiles, and the
variant at every launch shape of ``SWEEP``, each checked against ``reference.fused_moe`` first (relative error <
1e-2) and timed as ``CALLS`` layers in one graph, each with its own input and routing (so the experts hit differ
between calls, as between a step's layers, and L2 does not serve them), per layer; the floor is the bytes of the
experts hit at the measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.moe_decode_bench [--out moe_decode_bench.json]`` (``$OUT/...``
when ``$OUT`` is set).
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed
from bench.moe_bench import layer_weights
from blink.models.kernels import reference
from blink.models.kernels.moe import combine_top_k, fused_moe, route
from blink.models.shapes import shape_config

TOKENS = (1, 2, 4, 8)
CALLS = 8
# Weight tiles of at most 8K elements: two of them (gate and up) per program stay in registers.
SWEEP = [dict(block_n=n, block_k=k, num_warps=w) for n, k, w in itertools.product((8, 16, 32), (128, 256, 512), (4, 8))
         if n * k <= 8192]


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, inter, hidden, top_k, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """``act[entry, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n])`` for entry ``program_id(0)`` (token
    ``entry // top_k``, expert ``ids[entry]``), gate, up and the product rounded to the output dtype as the reference
    does."""
    entry, tile = tl.program_id(0), tl.program_id(1)
    token = entry // top_k
    w_base = w_ptr + tl.load(ids_ptr + entry).to(tl.int64) * 2 * inter * hidden
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        x = tl.load(x_ptr + token.to(tl.int64) * hidden + k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(w_base + n[:, None] * hidden + k[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(w_base + (inter + n)[:, None] * hidden + k[None, :], mask=mask, other=0.0).to(tl.float32)
        gate += tl.sum(g * x[None, :], 1)
        up += tl.sum(u * x[None, :], 1)
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(act_ptr + entry.to(tl.int64) * inter + n, act.to(dtype), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, y_ptr, hidden, inter, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``y[entry, n] = (act[entry] . down[e, n]) * weight[entry]``, rounded to the dtype before and after the
    weight, as the reference does."""
    entry, tile = tl.program_id(0), tl.program_id(1)
    w_base = w_ptr + tl.load(ids_ptr + entry).to(tl.int64) * hidden * inter
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(act_ptr + entry.to(tl.int64) * inter + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_base + n[:, None] * inter + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], 1)
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + entry).to(tl.float32)
    tl.store(y_ptr + entry.to(tl.int64) * hidden + n, (acc.to(dtype).to(tl.float32) * weight).to(dtype), mask=n_ok)


def gemv_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
             block_n: int, block_k: int, num_warps: int) -> torch.Tensor:
    """The same MLP as ``fused_moe(..., renormalize=True)``: ``x [T, H]`` → ``[T, H]``."""
    weights, ids = route(router_logits, top_k, True)
    hidden, inter, entries = x.shape[1], gate_up.shape[1] // 2, x.shape[0] * top_k
    act = torch.empty((entries, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(entries, triton.cdiv(inter, block_n))](x, gate_up, ids, act, inter, hidden, top_k,
                                                            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    y = torch.empty((entries, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(entries, triton.cdiv(hidden, block_n))](act, down, ids, weights, y, hidden, inter, BLOCK_N=block_n,
                                                          BLOCK_K=block_k, num_warps=num_warps)
    return combine_top_k(y, top_k)


def bench_tokens(tokens: int, weights, top_k: int, bw: float, reps: int) -> dict:
    gate_up, down = weights
    experts, two_i, hidden = gate_up.shape
    calls = [(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
              torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)) for _ in range(CALLS)]
    want = reference.fused_moe(*calls[0], gate_up, down, top_k, True)
    hit = sum(reference.route(logits, top_k, True)[1].unique().numel() for _, logits in calls) / CALLS
    floor_us = hit * 3 * hidden * (two_i // 2) * 2 / bw * 1e6
    fused_err = rel_err(fused_moe(*calls[0], gate_up, down, top_k, True), want)
    fused_us = graph_ms(lambda: [fused_moe(x, logits, gate_up, down, top_k, True) for x, logits in calls],
                        reps) * 1e3 / CALLS
    results, best = sweep_timed(SWEEP, lambda shape: rel_err(gemv_moe(*calls[0], gate_up, down, top_k, **shape), want),
                                lambda shape, i: gemv_moe(*calls[i], gate_up, down, top_k, **shape), CALLS, reps)
    print(f"{tokens} tokens ({hit:.1f} experts hit): floor {floor_us:6.2f} us  fused {fused_us:6.2f} "
          f"(x{fused_us / floor_us:.2f}, err {fused_err:.1e})  " +
          (f"GEMV best {best['us']:6.2f} (x{best['us'] / floor_us:.2f}) {best}" if best else "GEMV: none"), flush=True)
    for r in results:
        if r["us"] is None:
            print(f"    {'does not fit' if r['error'] else 'WRONG'}: {r}", flush=True)
    return dict(tokens=tokens, experts_hit=hit, floor_us=floor_us, fused_us=fused_us, fused_rel_err=fused_err,
                best=best, sweep=results)


def main():
    args, bw, _ = kernel_bench_start(__doc__, "moe_decode_bench.json", reps=20, sweep=False)
    c = shape_config("qwen3-30b-a3b")
    weights = layer_weights(c)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; Qwen3-30B-A3B MoE layer, {CALLS} layers per "
          "graph", flush=True)
    rows = [bench_tokens(tokens, weights, c.num_experts_per_tok, bw, args.reps) for tokens in TOKENS]
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw, rows=rows), f,
                  indent=2)
    wrong = [r["tokens"] for r in rows for s in r["sweep"] if s["error"] is None and not s["rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"gemv_moe differs from the reference at {sorted(set(wrong))} tokens (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
