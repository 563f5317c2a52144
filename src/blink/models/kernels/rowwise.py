"""The GEMM of decode-sized steps by TMA, weight rows as the MMA's M: e4m3 activations (per-token scales) times e4m3
weights (per-row scales), reference ``reference.fp8_linear`` on the dequantized operands; or model-dtype operands
(bf16), reference the float64 product. Both take it from the skinny GEMM's rows up to ``linear.ROWWISE_UP_TO``
(bf16) or ``fp8.GEMM_UP_TO`` (FP8).

The arrangement of vLLM's CUTLASS FP8 kernel at these sizes (``KernelTmaWarpSpecializedFP8FastAccum`` with A and B
swapped): a program owns ``BLOCK_N`` weight rows, which are the MMA's M (Hopper's ``wgmma`` takes 64 rows there), and
the step's tokens are its N (``block_m_for``: the N of ``wgmma`` may be as small as 8, where a token-major tile's M
may not be below 64). Each stage brings ``BLOCK_K`` columns of both operands through host-built TMA
descriptors (``TensorDescriptor``: no address arithmetic per element, rows past the end read as zero), so six stages
of 64 x 256 weight bytes (128 bf16 columns) fit in shared memory and keep ~100 KB in flight per program without the
registers of ``tl.load`` pipelines. No split of the reduction: one program per 64 weight rows was the fastest on
every Qwen3-8B projection (``bench/experiments/fp8_tma_bench.py``).

Invariants: ``K`` is a multiple of 16 and both operands are contiguous with 16-byte aligned rows (TMA's global
strides), which ``tma_can_read`` checks; the descriptors hold the operands' addresses, so a captured step graph replays
them as captured (the step's buffers and weights keep their addresses).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .skinny import TARGET_PROGRAMS, block_m_for
from .pdl import pdl_args, wait_for_previous
from .tiles import check_tiles


@dataclass(frozen=True)
class RowwiseTiles:
    """Launch shape: ``block_n`` weight rows and ``block_k`` columns per stage, Triton's warps and pipeline stages
    (the tokens' tile follows the step's rows: ``skinny.block_m_for``)."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 6

    def __post_init__(self):
        check_tiles(self)


def tiles_for(n: int, element_size: int = 1) -> RowwiseTiles:
    """From the H100 sweep of ``bench/experiments/fp8_tma_bench.py`` (2026-12-06; Qwen3-8B's projections at 1, 16
    and 64 rows; each the best shape or within 1.03x of it there): 64 x 256 weight tiles, 6 stages deep where the
    tiles number at most ``TARGET_PROGRAMS`` (one program an SM streams alone: qkv, o_proj, down), else 3 (gate_up's
    384 tiles: two programs share an SM's shared memory). Model-dtype weights take the same bytes a stage (128
    columns)."""
    tiles = RowwiseTiles(block_k=256 // element_size)
    return tiles if triton.cdiv(n, tiles.block_n) <= TARGET_PROGRAMS else replace(tiles, num_stages=3)


def tma_can_read(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA can read both operands: contiguous, 16-byte aligned addresses and rows."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[1] % 16 == 0 for t in (a, weight))


@triton.jit
def _rowwise_kernel(w_desc, a_desc, w_scale_ptr, a_scale_ptr, out_ptr, m, n, k, SCALED: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """``out[m, n] = sum_k a[m, k] w[n, k]`` (times ``a_scale[m] * w_scale[n]`` where ``SCALED``) for this program's
    ``BLOCK_N`` weight rows and ``BLOCK_M`` tokens; the float32 tile is ``[weight rows, tokens]``, stored
    transposed."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        acc = tl.dot(w_desc.load([pid_n * BLOCK_N, k0]), a_desc.load([pid_m * BLOCK_M, k0]).T, acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < n, rows < m
    if SCALED:
        acc *= (tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[:, None]
                * tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)[None, :])
    tl.store(out_ptr + rows.to(tl.int64)[None, :] * n + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=col_ok[:, None] & row_ok[None, :])


def rowwise_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     out_dtype: torch.dtype, tiles: RowwiseTiles | None = None) -> torch.Tensor:
    """e4m3 ``a [M, K]`` with float32 per-token ``a_scale`` (``M`` values, contiguous) times e4m3 ``weight [N, K]``
    with float32 per-row ``scale [N]`` → ``[M, N]`` in ``out_dtype``; both operands as ``tma_can_read`` requires."""
    return _rowwise(a, weight, (a_scale, scale), out_dtype, tiles)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, tiles: RowwiseTiles | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` in the model dtype of both, as ``tma_can_read`` requires them."""
    return _rowwise(x, weight, None, x.dtype, tiles)


def _rowwise(a: torch.Tensor, weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
             out_dtype: torch.dtype, tiles: RowwiseTiles | None) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_can_read(a, weight):
        raise ValueError(f"the rowwise GEMM reads its operands by TMA: they must be contiguous with 16-byte aligned "
                         f"addresses and K a multiple of 16 (got a {tuple(a.shape)}, weight {tuple(weight.shape)})")
    (m, k), n = a.shape, weight.shape[0]
    tiles = tiles or tiles_for(n, a.element_size())
    block_m = block_m_for(m)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    w_desc = TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k])
    a_desc = TensorDescriptor.from_tensor(a, [block_m, tiles.block_k])
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, block_m))
    a_scale, scale = scales or (out, out)  # not read without scales
    _rowwise_kernel[grid](w_desc, a_desc, scale, a_scale, out, m, n, k, SCALED=scales is not None,
                          BLOCK_N=tiles.block_n, BLOCK_M=block_m, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
                          num_stages=tiles.num_stages, **pdl_args(a.device))
    return out
