"""FP8 projections on Hopper; reference: ``reference.fp8_linear`` (dequantize, then one GEMM).

Activations are quantized per token inside the step (``kernels.quantize``: one kernel, fixed shapes, no host
reads, so it captures into the step graph), or come quantized from the kernel before the projection (``QuantizedRows``
from the RMSNorms and SiLU-and-multiply, where ``fp8_takes_e4m3``), then:

- per-row weight scales: ``torch._scaled_mm`` with row-wise scaling (cuBLASLt on sm90 with CUDA >= 12.9, else
  CUTLASS). Its contract (torch 2.11, ``ScaledBlas.cpp``): the first operand row-major ``[M, K]``, the second
  column-major ``[K, N]`` (``weight.t()`` of the row-major ``[N, K]`` weight), ``K`` and ``N`` multiples of 16,
  ``scale_a`` float32 ``[M, 1]`` and ``scale_b`` float32 ``[1, N]``, both contiguous; the output bf16/fp16/fp32.
  cuBLASLt picks 128x128 tiles, so a Qwen3-8B qkv projection of a few dozen tokens runs on 48 programs, a third of
  the SMs: up to ``GEMM_UP_TO`` rows ``rowwise`` computes the same (TMA, the weight rows as the MMA's M), and
  ``fp8_gemm`` where TMA cannot read the operands.
- block weight scales (``weight_block_size = (bn, bk)``): ``fp8_gemm``, activations scaled per token and ``bk``
  columns (DeepSeek-V3's scheme): each ``bk`` step of the reduction is one e4m3 ``tl.dot`` in float32, times the
  token's and the weight block's scales.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..e4m3 import QuantizedRows
from .rowwise import rowwise_fp8_gemm, tma_can_read
from .skinny import TARGET_PROGRAMS, skinny_linear
from .pdl import pdl_args, wait_for_previous
from .quantize import quantize_activations
from .split_k import split_buffers, store_split
from .tiles import check_tiles


# Steps of up to this many rows take the skinny GEMM (at 32 rows the faster on three of Qwen3-8B's four projections,
# level on the fourth); at 64, activations quantized per token through torch._scaled_mm are as fast or faster on all
# four (fp8_gemv_bench, H100).
SKINNY_UP_TO = 32
# Per-row steps of up to this many rows take the rowwise GEMM: at 64 fp8_gemm beat _scaled_mm on all four projections
# (100 against 115 us a layer), at 128 they were level, at 256 _scaled_mm was the faster (fp8_gemv_bench, H100), and
# at 64 rowwise beats fp8_gemm (82.5 against 89.0 us a layer: fp8_tma_bench, H100).
GEMM_UP_TO = 64


@dataclass(frozen=True)
class Tiles:
    """Launch shape of ``fp8_gemm``: ``block_m`` tokens and ``block_n`` outputs per program, ``block_k`` columns per
    step of the reduction (with block scales the weight block's ``bk``, whatever is given), the reduction split
    ``split_k`` ways, Triton's warps and pipeline stages."""

    block_m: int
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(self)


def tiles_for(m: int, n: int, k: int) -> Tiles:
    """Up to ``GEMM_UP_TO`` rows, from the H200 sweeps of ``bench/experiments/fp8_gemv_bench.py`` at 64 rows (per-row
    scales, the parts summed in the kernel; block scales take the same, not swept): 64 tokens by 32 outputs where
    64-output tiles would number fewer than ``TARGET_PROGRAMS``, else 64; a long reduction (``k >= 2n``) split 4 ways,
    another split 2 ways where its tiles number fewer than two per SM (each program then re-reads the activations
    over half the reduction); 4 warps, 4 stages. Each of Qwen3-8B's four projections took its best shape there
    (qkv 12.5, o_proj 10.4, gate_up 29.0, down 20.8 us against 14.7, 12.8, 29.4, 21.7 with 8 warps and qkv and
    o_proj unsplit). Beyond (only block scales come here): 64-row tiles of 128 outputs, not yet swept."""
    if m <= GEMM_UP_TO:
        block_n = 32 if triton.cdiv(n, 64) < TARGET_PROGRAMS else 64
        programs = triton.cdiv(m, 64) * triton.cdiv(n, block_n)
        split_k = 4 if k >= 2 * n else 1 if programs >= 2 * TARGET_PROGRAMS else 2
        return Tiles(block_m=64, block_n=block_n, split_k=split_k, num_warps=4, num_stages=4)
    return Tiles(block_m=64)


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, work_ptr, counter_ptr, m, n, k, a_scale_stride,
                     w_scale_stride, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """``out[m, n] = sum_k a[m, k] w[n, k]`` times the scales, of which this program sums K part ``program_id(2)``
    (``split_k.store_split``); ``a`` ``[m, k]`` and ``w`` ``[n, k]`` e4m3, contiguous. ``GROUP_K == 0``: per-token
    ``a_scale [m]`` and per-row ``w_scale [n]``, applied once at the end; else block scales ``a_scale[m, k //
    GROUP_K]`` and ``w_scale[n // GROUP_N, k // GROUP_K]`` applied at each step (``BLOCK_K == GROUP_K``)."""
    pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    per_part = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K
    w_scales = w_scale_ptr + (cols // GROUP_N).to(tl.int64) * w_scale_stride  # GROUP_N == 1 per row: scale[n]
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(part * per_part, tl.minimum(k, (part + 1) * per_part), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * k + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * k + kk[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if GROUP_K == 0:
            acc += tl.dot(a, w)
        else:
            a_s = tl.load(a_scale_ptr + rows * a_scale_stride + k0 // GROUP_K, mask=row_ok, other=0.0)
            w_s = tl.load(w_scales + k0 // GROUP_K, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    if GROUP_K == 0:
        acc *= (tl.load(a_scale_ptr + rows * a_scale_stride, mask=row_ok, other=0.0)[:, None]
                * tl.load(w_scales, mask=col_ok, other=0.0)[None, :])
    store_split(acc, out_ptr, work_ptr, counter_ptr + pid_m * tl.num_programs(1) + pid_n,
                rows.to(tl.int64)[:, None] * n + cols[None, :], row_ok[:, None] & col_ok[None, :], part, m * n, SPLIT_K)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None, out_dtype: torch.dtype, tiles: Tiles | None = None) -> torch.Tensor:
    """e4m3 ``a [M, K]`` with float32 ``a_scale`` (``[M, 1]`` per token, or ``[M, K/bk]``) times e4m3 ``weight [N,
    K]`` with float32 ``scale`` (``[N]`` per row, or ``[N/bn, K/bk]`` per ``block``), all contiguous → ``[M, N]`` in
    ``out_dtype``."""
    (m, k), n = a.shape, weight.shape[0]
    tiles = tiles or tiles_for(m, n, k)
    if block is not None:
        tiles = replace(tiles, block_k=block[1])
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    group_n, group_k = block if block is not None else (1, 0)
    work, counters = split_buffers(out, weight, tiles.split_k, grid[0] * grid[1])
    _fp8_gemm_kernel[grid](a, a_scale, weight, scale, out, work, counters, m, n, k, a_scale.stride(0), scale.stride(0),
                           GROUP_N=group_n, GROUP_K=group_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                           BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k, num_warps=tiles.num_warps,
                           num_stages=tiles.num_stages, **pdl_args(a.device))
    return out


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``a [M, K]`` with float32 per-token ``a_scale [M]`` times e4m3 ``weight [N, K]`` with float32 per-row
    ``scale [N]`` → ``[M, N]`` in ``out_dtype``, by ``torch._scaled_mm``'s row-wise scaling."""
    return torch._scaled_mm(a, weight.t(), scale_a=a_scale.reshape(-1, 1), scale_b=scale.reshape(1, -1),
                            out_dtype=out_dtype)


def fp8_takes_e4m3(rows: int, block: tuple[int, int] | None) -> bool:
    """Whether an FP8 projection of ``rows`` rows takes its activations quantized by the kernel that produces them
    (RMSNorm, SiLU-and-multiply: ``QuantizedRows``, per token, and per ``bk`` columns with block scales), saving the
    quantization's launch: beyond the skinny GEMM's rows."""
    return rows > SKINNY_UP_TO


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """``x [M, K]`` times e4m3 ``weight [N, K]`` with per-row ``scale [N]`` or per-``block`` scales → ``[M, N]`` in
    ``x.dtype``: decode-sized steps by the weight-only skinny GEMM (``skinny``), larger ones with activations
    quantized per token (and per ``bk`` columns with block scales), or taken quantized (``fp8_takes_e4m3``)."""
    if isinstance(x, QuantizedRows):
        a, a_scale, dtype = x
    elif x.shape[0] <= SKINNY_UP_TO:
        return skinny_linear(x, weight, scale, block)
    else:
        (a, a_scale), dtype = quantize_activations(x, x.shape[-1] if block is None else block[1]), x.dtype
    if block is None and a.shape[0] > GEMM_UP_TO:
        return scaled_mm(a, a_scale, weight, scale, dtype)
    if block is None and tma_can_read(a, weight):
        return rowwise_fp8_gemm(a, a_scale.reshape(-1), weight, scale, dtype)
    return fp8_gemm(a, a_scale, weight, scale, block, dtype)
