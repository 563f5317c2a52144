"""Fused mixture-of-experts MLP in Triton; reference: ``reference.fused_moe`` (``route`` + ``moe_experts``).

A step of ``T`` tokens, each routed to ``top_k`` of ``E`` experts, has ``N = T * top_k`` (token, expert) *entries*;
entry ``t * top_k + j`` is token ``t``'s ``j``-th choice. Four launches, all with grids fixed by ``(T, top_k, E)``, and
no host reads, so the whole MLP captures into a step graph:

1. ``_moe_route_kernel`` (one program per token): softmax over the router logits in float32, the ``top_k`` largest
   (ties: lowest expert), optionally renormalised, rounded to the model dtype.
2. ``_moe_align_kernel`` (one program per expert): counts every expert's entries (histogram), pads each expert's count
   to a multiple of ``BLOCK_M`` and lays the experts out in order, so that every ``BLOCK_M`` block of ``sorted_entries``
   belongs to one expert (``expert_blocks``). Entries keep their order within an expert; padding slots hold ``N``.
   ``total`` (on the device) is the padded length: the per-expert counts never become Python values, so the buffers
   are sized for the worst case, ``N + min(E, N) * (BLOCK_M - 1)`` slots. Each program scans the entries in chunks
   of up to ``MAX_CHUNK`` (its loops are latency-bound: at 2048 tokens, 256-entry chunks took 58 us per layer).
3. ``_moe_gemm_kernel`` twice, one program per (block, output tile), blocks past ``total`` exiting at once: a grouped
   GEMM of each block's rows with its expert's weights. First ``x @ gate_up[e].T`` with SiLU-and-mul fused into the
   epilogue (``[N, I]``), then ``@ down[e].T`` times the entry's routing weight (``[N, H]``).
   FP8 experts (``quantization.py``): ``x`` and the gated products are quantized per token (and per ``bk``
   columns with block scales) by ``kernels.quantize`` before each GEMM, which multiplies e4m3 tiles and applies the
   scales (``QUANT``).
4. ``_moe_sum_top_k_kernel``: the weighted combine, each token's ``top_k`` rows summed in float32 and rounded once, as
   torch's sum of them does (one launch instead of torch's strided reduction).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous
from .quantize import quantize_activations
from .tiles import check_tiles

MAX_CHUNK = 2048
SUM_BLOCK = 256  # hidden columns per program of the top-k combine


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the two expert GEMMs: ``block_m`` rows per block (entries of one expert), ``block_n`` outputs
    and ``block_k`` reduction columns per tile (powers of two, at least 16 for ``tl.dot``), and Triton's warps and
    software-pipeline stages. ``tiles_for`` picks the default; ``bench/moe_bench.py --sweep`` times others."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(self)


def tiles_for(num_entries: int, num_experts: int) -> Tiles:
    """While experts average at most 16 entries (decode): 16-row blocks, 128 columns of K per step; else (prefill)
    64-row blocks. From ``bench/moe_bench.py --sweep`` on the H200 (62e7a4a, Qwen3-30B-A3B's layer): K steps of 128
    took the expert GEMMs from 40.5 / 145 / 306 / 337 us to 34.5 / 133 / 292 / 332 us at 1 / 8 / 64 / 256 tokens;
    at 1024 and 2048 tokens the prefill default was the fastest shape."""
    if num_entries <= 16 * num_experts:
        return Tiles(block_m=16, block_k=128)
    return Tiles(block_m=64)


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride, TOP_K: tl.constexpr,
                      TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    wait_for_previous(PDL)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)  # lanes past num_experts hold 0, below every real expert's probability or tied with it
    slots = tl.arange(0, TOP_K_P2)
    w = tl.zeros([TOP_K_P2], tl.float32)
    ids = tl.zeros([TOP_K_P2], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, 0)  # the first maximum: the lowest expert wins a tie
        w = tl.where(slots == j, tl.max(p, 0), w)
        ids = tl.where(slots == j, best, ids)
        p = tl.where(e == best, -1.0, p)
    if RENORMALIZE:
        w = w / tl.sum(w, 0)
    tl.store(weights_ptr + t * TOP_K + slots, w.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_blocks_ptr, total_ptr, num_entries, num_experts,
                      BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    e = tl.program_id(0)
    wait_for_previous(PDL)
    counts = tl.zeros([BINS], tl.int32)
    for start in range(0, num_entries, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        counts += tl.histogram(tl.load(ids_ptr + offs, mask=offs < num_entries, other=num_experts), BINS)
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < num_experts, counts, 0)  # bin num_experts counted the masked lanes
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    begin = tl.sum(tl.where(bins == e, ends - padded, 0), 0)
    count = tl.sum(tl.where(bins == e, counts, 0), 0)
    size = tl.sum(tl.where(bins == e, padded, 0), 0)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, 0))
    placed = 0
    for start in range(0, num_entries, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mine = tl.load(ids_ptr + offs, mask=offs < num_entries, other=num_experts) == e
        rank = placed + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + begin + rank, offs, mask=mine)
        placed += tl.sum(mine.to(tl.int32), 0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + begin + count + pad, num_entries, mask=pad < size - count)
    for b in range(0, size // BLOCK_M, CHUNK):
        blocks = b + tl.arange(0, CHUNK)
        tl.store(expert_blocks_ptr + begin // BLOCK_M + blocks, e, mask=blocks < size // BLOCK_M)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, expert_blocks_ptr, total_ptr, num_entries,
                     n_out, k_dim, a_stride, w_stride_e, w_stride_n, entries_per_a_row, a_scale_ptr, w_scale_ptr,
                     a_scale_stride, w_scale_stride_e, w_scale_stride_n, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                     QUANT: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """``out[entry, n] = a[entry // entries_per_a_row] . w[expert, n]`` for the block's entries; ``GATED``: ``w``
    has ``2 * n_out`` rows and ``out = silu(gate) * up`` of rows ``n`` and ``n_out + n``; ``WEIGHTED``: times the
    entry's routing weight. Gate, up and the product are rounded to the output dtype as the reference does.

    ``QUANT`` 0: ``a`` and ``w`` in the model dtype. FP8 (``a`` and ``w`` e4m3, float32 scales): 1, per-row weight
    scales ``[E, N]`` and one scale per ``a`` row, applied after the reduction; 2, weight scales per ``GROUP_N`` rows
    and ``BLOCK_K`` columns ``[E, N/GROUP_N, K/BLOCK_K]`` and ``a`` scales per row and ``BLOCK_K`` columns, applied
    at every step of the reduction."""
    block, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    if block * BLOCK_M >= tl.load(total_ptr):
        return
    entries = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entries < num_entries
    rows = (entries // entries_per_a_row).to(tl.int64)
    expert = tl.load(expert_blocks_ptr + block).to(tl.int64)
    w_base = w_ptr + expert * w_stride_e
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    a_scales = a_scale_ptr + rows * a_scale_stride
    gate_scales = w_scale_ptr + expert * w_scale_stride_e + (n // GROUP_N) * w_scale_stride_n
    up_scales = w_scale_ptr + expert * w_scale_stride_e + ((n_out + n) // GROUP_N) * w_scale_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_dim
        a = tl.load(a_ptr + rows[:, None] * a_stride + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.dot(a, tl.load(w_base + n[None, :] * w_stride_n + k[:, None], mask=w_mask, other=0.0))
        if QUANT == 2:
            a_s = tl.load(a_scales + k0 // BLOCK_K, mask=valid, other=0.0)[:, None]
            gate = gate * a_s * tl.load(gate_scales + k0 // BLOCK_K, mask=n_ok, other=0.0)[None, :]
        acc += gate
        if GATED:
            up = tl.dot(a, tl.load(w_base + (n_out + n)[None, :] * w_stride_n + k[:, None], mask=w_mask, other=0.0))
            if QUANT == 2:
                up = up * a_s * tl.load(up_scales + k0 // BLOCK_K, mask=n_ok, other=0.0)[None, :]
            acc_up += up
    if QUANT == 1:
        a_s = tl.load(a_scales, mask=valid, other=0.0)[:, None]
        acc = acc * a_s * tl.load(gate_scales, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * a_s * tl.load(up_scales, mask=n_ok, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if WEIGHTED:
        weight = tl.load(weights_ptr + entries, mask=valid, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    out = out_ptr + entries.to(tl.int64)[:, None] * n_out + n[None, :]
    tl.store(out, acc.to(dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_top_k_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    t, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * hidden + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` (unit stride in E) → (weights ``[T, top_k]`` in the logits' dtype, int32 ids)."""
    t, experts = router_logits.shape
    weights = torch.empty((t, top_k), dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    # One warp: the top-k rounds are reductions over the experts, by shuffles alone (4 warps meet in shared memory
    # twice a round: ~3.9 us per call at batch 1 on the H200, 16 rounds for top-8).
    _moe_route_kernel[(t,)](router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
                            TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            BLOCK_E=triton.next_power_of_2(experts), num_warps=1, **pdl_args(router_logits.device))
    return weights, ids


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries ``ids`` (int32, ``N`` of them, each in ``[0, E)``) sorted by expert, each expert padded to
    ``block_m``: (``sorted_entries`` int32 ``[max_slots]``, ``expert_blocks`` int32 ``[max_slots // block_m]``,
    ``total`` int32 ``[1]``). Slots ``>= total`` and their blocks are unwritten."""
    n = ids.numel()
    max_slots = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_entries = torch.empty(max_slots, dtype=torch.int32, device=ids.device)
    expert_blocks = torch.empty(max_slots // block_m, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(num_experts,)](ids, sorted_entries, expert_blocks, total, n, num_experts, BLOCK_M=block_m,
                                      BINS=triton.next_power_of_2(num_experts + 1),
                                      CHUNK=min(MAX_CHUNK, triton.next_power_of_2(max(n, 16))), **pdl_args(ids.device))
    return sorted_entries, expert_blocks, total


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, tiles: Tiles | None = None, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x [T, H]``, routing ``weights`` and int32 ``ids [T, top_k]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``
    (all contiguous) → ``[T, H]``. FP8 experts come with their scales (``[E, N]`` per row, or ``[E, N/bn, K/bk]``
    per ``block``); then ``x`` and the gated products are quantized per token (and ``bk`` columns) before each GEMM,
    and the reduction steps by ``bk`` with block scales."""
    (t, hidden), (experts, two_i, _), top_k = x.shape, gate_up.shape, ids.shape[1]
    inter, n = two_i // 2, t * top_k
    tiles = tiles or tiles_for(n, experts)
    quant = 0 if gate_up_scale is None else 1 if block is None else 2
    if quant == 2:
        tiles = replace(tiles, block_k=block[1])
    sorted_entries, expert_blocks, total = align(ids, experts, tiles.block_m)
    blocks = expert_blocks.numel()
    shape = dict(QUANT=quant, GROUP_N=block[0] if quant == 2 else 1, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                 BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(x.device))
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    a, a_scale = _operand(x, quant, block)
    _moe_gemm_kernel[(blocks, triton.cdiv(inter, tiles.block_n))](
        a, gate_up, act, weights, sorted_entries, expert_blocks, total, n, inter, hidden, a.stride(0),
        gate_up.stride(0), gate_up.stride(1), top_k, *_scale_args(a_scale, gate_up_scale, gate_up), GATED=True,
        WEIGHTED=False, **shape)
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    a, a_scale = _operand(act, quant, block)
    _moe_gemm_kernel[(blocks, triton.cdiv(hidden, tiles.block_n))](
        a, down, y, weights, sorted_entries, expert_blocks, total, n, hidden, inter, a.stride(0),
        down.stride(0), down.stride(1), 1, *_scale_args(a_scale, down_scale, down), GATED=False, WEIGHTED=True,
        **shape)
    return combine_top_k(y, top_k)


def _operand(x: torch.Tensor, quant: int, block: tuple[int, int] | None):
    """A GEMM's activations as the kernel reads them: ``x`` itself (no scales), or e4m3 with its scales."""
    if quant == 0:
        return x, None
    return quantize_activations(x, x.shape[1] if block is None else block[1])


def _scale_args(a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, w: torch.Tensor) -> tuple:
    """``a_scale_ptr, w_scale_ptr`` and their strides; without FP8, the weights stand in for pointers never read."""
    if a_scale is None:
        return w, w, 0, 0, 0
    return a_scale, w_scale, a_scale.stride(0), w_scale.stride(0), w_scale.stride(1)


def combine_top_k(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's ``top_k`` consecutive rows of ``y [T * top_k, H]`` (already weighted) summed in float32 and
    rounded once → ``[T, H]``."""
    t, hidden = y.shape[0] // top_k, y.shape[1]
    out = torch.empty((t, hidden), dtype=y.dtype, device=y.device)
    _moe_sum_top_k_kernel[(t, triton.cdiv(hidden, SUM_BLOCK))](y, out, hidden, TOP_K=top_k, BLOCK_H=SUM_BLOCK,
                                                               **pdl_args(y.device))
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
              renormalize: bool, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """A mixture-of-experts MLP, ``x [T, H]`` → ``[T, H]``: ``route`` then ``moe_experts`` (FP8 experts with their
    scales)."""
    weights, ids = route(router_logits, top_k, renormalize)
    return moe_experts(x, weights, ids, gate_up, down, None, gate_up_scale, down_scale, block)
