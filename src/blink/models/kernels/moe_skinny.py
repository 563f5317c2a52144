"""The routed experts of a decode-sized step in two launches (``skinny_moe``); reference: ``reference.moe_experts``.

At a few tokens the fused MoE kernel (``moe.py``) spends most of its launches around its two weight streams: the
alignment (each expert's entries padded to a 16-row block that holds one live row), the top-k combine, and with FP8
experts the quantization of ``x`` and of the gated products. Each is a launch of a few microseconds, 48 layers a step
on Qwen3-30B-A3B, against weight streams of a few microseconds each. ``moe.takes_skinny`` sends such steps here, as
``fp8_skinny`` takes the dense projections of decode-sized steps:

1. ``_gated_kernel``, one program per (entry, ``BLOCK_N`` columns of the expert width): the entry's expert id from
   the routing, its gate and up rows of those columns against the token's activations (one row, as they are), SiLU
   and multiply rounded as the fused kernel rounds them → ``act [T * top_k, I]``.
2. ``_down_kernel``, one program per (token, ``BLOCK_N`` columns of the hidden size): the down rows of all the token's
   top_k entries streamed in one reduction loop, each against the entry's ``act``; each entry's sum rounded, times its
   routing weight rounded, summed in float32 and rounded once: the fused kernel's epilogue and ``combine_top_k`` in
   one.

Weights in the model dtype or e4m3 (upcast as they load; e4m3 is exact in float32) with per-row scales (applied
after the reduction) or block scales (per ``GROUP_N`` rows and ``GROUP_K`` columns, at every step of it); the
activations are never quantized, so an FP8 step here computes what the reference does with dequantized weights.
Each program keeps a float32 accumulator of its tile (``[BLOCK_N, BLOCK_K]``, or ``[top_k, BLOCK_N, BLOCK_K]``) and
reduces it once, so the reduction loop is loads and multiply-adds only. An expert that several entries chose is
streamed once per entry: with at most one entry per ``SKINNY_EXPERTS_PER_ENTRY`` experts (``moe.takes_skinny``)
that is about an eighth more weight bytes at the limit, none at one token (a token's top_k experts are distinct).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_skinny import TARGET_PROGRAMS, SkinnyTiles
from .pdl import pdl_args, wait_for_previous

BLOCK_K = 128
ACCUMULATOR = 8192  # values of the down launch's accumulator a program holds


@triton.jit
def _dot_rows(a_row, w_rows, n_ok, k_dim, scales, QUANT: tl.constexpr, GROUP_K: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``w_rows . a`` in float32 for one activation row (``a_row``: a pointer) and ``BLOCK_N`` weight rows
    (``w_rows``: pointers to their first column). ``QUANT`` 1: ``scales`` points at each row's scale; 2: at each
    row's block-scale row, one scale per ``GROUP_K`` columns."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_dim
        a = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if QUANT == 2:
            w = w * tl.load(scales + k0 // GROUP_K, mask=n_ok, other=0.0)[:, None]
        acc += w * a[None, :]
    out = tl.sum(acc, 1)
    if QUANT == 1:
        out = out * tl.load(scales, mask=n_ok, other=0.0)
    return out


@triton.jit
def _row_scales(scale_ptr, expert, rows, scale_stride_e, scale_stride_n, GROUP_N: tl.constexpr):
    """Pointers to the scales of weight ``rows`` of ``expert``: its own scale per row (``GROUP_N`` 1), or the start
    of its block-scale row."""
    return scale_ptr + expert * scale_stride_e + (rows // GROUP_N) * scale_stride_n


@triton.jit
def _gated_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, inter, hidden, x_stride, w_stride_e, scale_ptr, scale_stride_e,
                  scale_stride_n, TOP_K: tl.constexpr, QUANT: tl.constexpr, GROUP_N: tl.constexpr,
                  GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """``act[entry, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n])`` for ``BLOCK_N`` columns ``n`` of the
    entry's expert ``e``; gate, up and the product rounded to the model dtype as the fused kernel rounds them."""
    entry, tile = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    wait_for_previous(PDL)
    expert = tl.load(ids_ptr + entry).to(tl.int64)
    a_row = x_ptr + (entry // TOP_K).to(tl.int64) * x_stride
    rows = w_ptr + expert * w_stride_e + n.to(tl.int64) * hidden
    gate = _dot_rows(a_row, rows, n_ok, hidden, _row_scales(scale_ptr, expert, n, scale_stride_e, scale_stride_n,
                                                            GROUP_N), QUANT, GROUP_K, BLOCK_N, BLOCK_K)
    up = _dot_rows(a_row, rows + inter * hidden, n_ok, hidden,
                   _row_scales(scale_ptr, expert, inter + n, scale_stride_e, scale_stride_n, GROUP_N), QUANT, GROUP_K,
                   BLOCK_N, BLOCK_K)
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(act_ptr + entry.to(tl.int64) * inter + n, act.to(dtype), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter, w_stride_e, scale_ptr, scale_stride_e,
                 scale_stride_n, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, QUANT: tl.constexpr,
                 GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """``out[token, n] = sum_j round(round(act[entry_j] . down[e_j, n]) * weight_j)`` over the token's ``TOP_K``
    entries, in float32, rounded once. One reduction loop streams every entry's ``BLOCK_N`` rows together (a
    ``[TOP_K_P2, BLOCK_N, BLOCK_K]`` accumulator), so the weight stream ramps once a program, not once an expert."""
    token, tile = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, TOP_K_P2)
    ok = (j < TOP_K)[:, None] & (n < hidden)[None, :]
    dtype = out_ptr.dtype.element_ty
    wait_for_previous(PDL)
    entry = token.to(tl.int64) * TOP_K + j
    expert = tl.load(ids_ptr + entry, mask=j < TOP_K, other=0).to(tl.int64)
    rows = w_ptr + expert[:, None] * w_stride_e + n.to(tl.int64)[None, :] * inter
    scales = _row_scales(scale_ptr, expert[:, None], n[None, :], scale_stride_e, scale_stride_n, GROUP_N)
    acc = tl.zeros([TOP_K_P2, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(act_ptr + entry[:, None] * inter + k[None, :], mask=(j < TOP_K)[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(rows[:, :, None] + k[None, None, :], mask=ok[:, :, None] & k_ok[None, None, :],
                    other=0.0).to(tl.float32)
        if QUANT == 2:
            w = w * tl.load(scales + k0 // GROUP_K, mask=ok, other=0.0)[:, :, None]
        acc += w * a[:, None, :]
    y = tl.sum(acc, 2)
    if QUANT == 1:
        y = y * tl.load(scales, mask=ok, other=0.0)
    weight = tl.load(weights_ptr + entry, mask=j < TOP_K, other=0.0).to(tl.float32)
    part = (y.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)
    total = tl.sum(tl.where(ok, part, 0.0), 0)
    tl.store(out_ptr + token.to(tl.int64) * hidden + n, total.to(dtype), mask=n < hidden)


def skinny_moe_tiles(units: int, n_out: int, block: tuple[int, int] | None) -> SkinnyTiles:
    """Launch shape over ``units`` (entries, or tokens) times ``n_out`` columns: 32 columns a program while that
    still gives ``TARGET_PROGRAMS`` programs, else 16 (one token's down projection: 2048 / 16 = 128 programs on
    Qwen3-30B-A3B); ``BLOCK_K`` columns a step, or one weight block's; the reduction never split (its programs are
    many already, and the rounding above needs the whole sum)."""
    block_n = 32 if units * triton.cdiv(n_out, 32) >= TARGET_PROGRAMS else 16
    tiles = SkinnyTiles(block_n=block_n, block_k=BLOCK_K, num_stages=3)
    if block is None:
        return tiles
    return SkinnyTiles(block_n=min(block_n, block[0]), block_k=min(BLOCK_K, block[1]), num_stages=3)


def down_tiles(tokens: int, hidden: int, top_k: int, block: tuple[int, int] | None) -> SkinnyTiles:
    """The down launch's shape: ``skinny_moe_tiles``' columns a program, and as many reduction columns a step as keep
    the ``[top_k, BLOCK_N, BLOCK_K]`` accumulator at 8K values (32 registers a thread at 8 warps)."""
    block_n = skinny_moe_tiles(tokens, hidden, block).block_n
    block_k = min(BLOCK_K, max(16, ACCUMULATOR // (triton.next_power_of_2(top_k) * block_n)))
    return SkinnyTiles(block_n=block_n, block_k=block_k if block is None else min(block_k, block[1]), num_warps=8,
                       num_stages=3)


def skinny_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
               block: tuple[int, int] | None = None, tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """``moe.moe_experts``'s contract (``x [T, H]``, routing ``weights`` and int32 ``ids [T, top_k]``, ``gate_up [E,
    2I, H]``, ``down [E, H, I]``, all contiguous; FP8 experts with their scales) in two launches → ``[T, H]``. The
    gate/up launch takes the shape ``tiles`` when given (the reduction unsplit, whole weight blocks), else
    ``skinny_moe_tiles``'; the down launch ``down_tiles``'."""
    if tiles is not None and (tiles.split_k != 1 or block is not None and (block[0] % tiles.block_n or
                                                                           block[1] % tiles.block_k)):
        raise ValueError(f"skinny_moe takes tiles with split_k 1 that divide the weight blocks {block} (got {tiles})")
    (t, hidden), (_, two_i, _), top_k = x.shape, gate_up.shape, ids.shape[1]
    inter, entries = two_i // 2, t * top_k
    quant = 0 if gate_up_scale is None else 1 if block is None else 2
    group_n, group_k = block if quant == 2 else (1, 1)
    constants = dict(TOP_K=top_k, QUANT=quant, GROUP_N=group_n, GROUP_K=group_k, **pdl_args(x.device))
    act = torch.empty((entries, inter), dtype=x.dtype, device=x.device)
    shape = tiles or skinny_moe_tiles(entries, inter, block)
    _gated_kernel[(entries, triton.cdiv(inter, shape.block_n))](
        x, gate_up, ids, act, inter, hidden, x.stride(0), gate_up.stride(0), *_scales(gate_up_scale, gate_up),
        **constants, **_shape(shape))
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    shape = down_tiles(t, hidden, top_k, block)
    _down_kernel[(t, triton.cdiv(hidden, shape.block_n))](
        act, down, ids, weights, out, hidden, inter, down.stride(0), *_scales(down_scale, down), **constants,
        TOP_K_P2=triton.next_power_of_2(top_k), **_shape(shape))
    return out


def _shape(tiles: SkinnyTiles) -> dict:
    return dict(BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _scales(scale: torch.Tensor | None, w: torch.Tensor) -> tuple:
    """A kernel's ``scale_ptr`` and its expert and row strides; without FP8, the weights stand in for a pointer never
    read."""
    return (w, 0, 0) if scale is None else (scale, scale.stride(0), scale.stride(1))
