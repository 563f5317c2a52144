"""Decode-sized GEMMs (``M <= SKINNY_MAX_TOKENS`` rows): model-dtype or FP8 weights times model-dtype activations.

A decode step reads every weight once and does little arithmetic with it: its time is the weight bytes over HBM
bandwidth, and for a small model's projections (a few MB each) each GEMM's ramp as much. cuBLAS's launch shape for
Qwen3-0.6B's qkv projection at one row took 12.5 us on the H200 for 8.4 MB (2 us of bytes), and its kernels cannot
wait in the step's programmatic-dependent-launch chain (``pdl``). ``skinny_linear`` is one kernel for both weight
formats. Model-dtype weights are read as they are. FP8 halves the bytes only if the GEMM streams them at the rate
bf16 cuBLAS streams its own, and at a few rows neither ``torch._scaled_mm`` (a 128x128-tile kernel, 29 us per 8B
projection at M = 1 on the H200, twice the bf16 time) nor quantizing the activations per token first (a launch of its
own) does. So a decode step does not quantize its activations at all: each program loads ``BLOCK_N`` weight rows'
e4m3 bytes, upcasts them in registers (e4m3 is exact in bf16) and multiplies them with the activations as they are,
one ``tl.dot`` per ``BLOCK_K`` columns; the scales apply per weight row at the end (per row) or per ``(bn, bk)``
weight block along the reduction (block).

The K dimension may be split over ``SPLIT_K`` programs to fill the SMs when ``N / BLOCK_N`` tiles are too few; the
last part of a tile to finish sums the parts (``split_k``). References: ``F.linear`` for model-dtype weights;
``reference.fp8_linear`` (dequantize, then one GEMM) for FP8 ones, the same maths without the activations' rounding
to e4m3.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous
from .split_k import split_buffers, store_split
from .tiles import check_tiles
from .widen import widen

SKINNY_MAX_TOKENS = 64  # up to here a step's rows fit one BLOCK_M of tl.dot and the step is weight-bound
TARGET_PROGRAMS = 128  # about one per SM of an H100 or H200 (132)


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape: ``block_n`` weight rows and ``block_k`` columns per iteration, the reduction split
    ``split_k`` ways, Triton's warps and pipeline stages (``block_m`` follows the step's rows)."""

    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_tiles(self)


def skinny_tiles(m: int, n: int, k: int, block: tuple[int, int] | None, element_size: int = 1) -> SkinnyTiles:
    """The launch shape of ``m`` rows through a projection of ``n`` outputs and ``k`` inputs of ``element_size``-byte
    weights. With block scales a tile must not straddle a weight block.

    FP8, from the sweeps of ``bench/experiments/fp8_gemv_bench.py`` (Qwen3-8B's projections; up to 16 rows on the H200
    with the parts summed in the kernel, each projection's best shape or within 1.02x of it; 32 rows on an H100, each
    the best shape there): 64-output tiles 3 stages deep, the reduction split 4 ways unless the tiles alone number
    ``TARGET_PROGRAMS`` (split, fewer bytes stream through each program and more are in flight per SM); 256 columns per
    iteration up to 16 rows, 128 beyond.

    bf16, from ``bench/experiments/gemv_bench.py --sweep`` (Qwen3-0.6B's, Llama-3.2-1B's and Qwen3-8B's projections at
    1 and 16 rows on an H100; each projection's best shape or within 1.04x of it): 32-output tiles of 128 columns, 4
    warps, 3 stages; the reduction split 4 ways where it is long (``k >= 2048``) and the tiles few (at most 1.5
    ``TARGET_PROGRAMS``), else not (Qwen3-0.6B's qkv and gate_up, ``k = 1024``; Llama-3.2-1B's 512-tile gate_up)."""
    if element_size == 1:
        split_k = 4 if triton.cdiv(n, 64) <= TARGET_PROGRAMS else 1
        tiles = SkinnyTiles(block_n=64, block_k=256 if m <= 16 and block is None else 128, split_k=split_k,
                            num_stages=3)
    else:
        split_k = 4 if k >= 2048 and triton.cdiv(n, 32) <= 3 * TARGET_PROGRAMS // 2 else 1
        tiles = SkinnyTiles(block_n=32, block_k=128, split_k=split_k, num_stages=3)
    if block is None:
        return tiles
    return replace(tiles, block_n=min(tiles.block_n, block[0]), block_k=min(tiles.block_k, block[1]))


def block_m_for(m: int) -> int:
    """The step's rows as a tile of ``tl.dot`` (which takes at least 16 along each side): rounded up to a power of
    two of at least 16; the skinny GEMM's M, ``rowwise``'s N."""
    return max(16, triton.next_power_of_2(m))


@triton.jit(do_not_specialize=["m"])  # one compile per launch shape, whatever the step's rows
def _skinny_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, work_ptr, counter_ptr, m, n, k, x_stride, scale_stride,
                   SCALED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """``out[:m, tile] = x[:m] @ (w[tile] * scale).T`` for output tile ``program_id(0)``, of which this program sums
    K part ``program_id(1)`` (``split_k.store_split``). Not ``SCALED``: ``w`` as it is (``scale_ptr`` unread);
    ``GROUP_K == 0``: per-row ``scale [n]``; else block ``scale [n/GROUP_N, k/GROUP_K]``."""
    tile, part = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    per_part = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * k
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(part * per_part, tl.minimum(k, (part + 1) * per_part), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = widen(tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0), x.dtype)
        if not SCALED or GROUP_K == 0:
            acc += tl.dot(x, tl.trans(w))
        else:
            s = tl.load(scale_ptr + (cols // GROUP_N) * scale_stride + k0 // GROUP_K, mask=col_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * s[None, :]
    if SCALED and GROUP_K == 0:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    store_split(acc, out_ptr, work_ptr, counter_ptr + tile, rows[:, None] * n + cols[None, :],
                row_ok[:, None] & col_ok[None, :], part, m * n, SPLIT_K)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None, tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """``x [M, K]`` (M <= ``SKINNY_MAX_TOKENS``, any float dtype) times ``weight [N, K]``: in ``x.dtype`` (no
    ``scale``), or e4m3 with per-row ``scale [N]`` or per-``block`` ``scale [N/bn, K/bk]`` → ``[M, N]`` in
    ``x.dtype``."""
    (m, k), n = x.shape, weight.shape[0]
    if m > SKINNY_MAX_TOKENS:
        raise ValueError(f"skinny_linear takes at most {SKINNY_MAX_TOKENS} rows (got {m})")
    if (scale is None) != (weight.dtype == x.dtype):
        raise ValueError(f"skinny_linear takes {x.dtype} weights without scales or e4m3 weights with them (got "
                         f"{weight.dtype} weights, {'no ' if scale is None else ''}scales)")
    if weight.stride() != (k, 1):
        raise ValueError(f"skinny_linear reads the weight's rows as {k} contiguous columns (got strides "
                         f"{weight.stride()}): pass weight.contiguous()")
    tiles = tiles or skinny_tiles(m, n, k, block, weight.element_size())
    if block is not None and (block[1] % tiles.block_k or block[0] % tiles.block_n):
        raise ValueError(f"tiles {tiles} do not divide the weight blocks {block}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    group_n, group_k = block if block is not None else (0, 0)
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k)
    work, counters = split_buffers(out, weight, tiles.split_k, grid[0])
    scaled = scale is not None
    _skinny_kernel[grid](
        x, weight, scale if scaled else weight, out, work, counters, m, n, k, x.stride(0),
        scale.stride(0) if scaled else 0, SCALED=scaled, GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_M=block_m_for(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(x.device))
    return out
