"""SiLU-and-mul in Triton; reference: ``reference.silu_and_mul``. With ``e4m3_group`` the products come out quantized
per token and that many columns (``QuantizedRows``), as ``kernels.quantize`` would quantize them: the input of an FP8
down projection, without a launch of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import FP8, QuantizedRows
from .pdl import pdl_args, wait_for_previous
from .quantize import check_group, e4m3_codes, e4m3_scale, row_launch, store_codes

BLOCK = 1024  # columns a program of the plain kernel holds


@triton.jit
def _product(x_ptr, row, col, n, mask, dtype: tl.constexpr):
    """``silu(gate) * up`` of ``row``'s columns ``col``, rounded to ``dtype`` (the model's), as float32."""
    gate = tl.load(x_ptr + row * 2 * n + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + col, mask=mask, other=0.0).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n
    tl.store(out_ptr + row * n + col, _product(x_ptr, row, col, n, mask, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_e4m3_kernel(x_ptr, out_ptr, scale_ptr, n, groups, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
    """One program a row (``out_ptr``: bytes). ``GROUP`` 0, one scale for a row wider than ``BLOCK``: its products'
    largest magnitude, then the products again (gate and up from cache), as e4m3 codes of that scale. Else one scale
    per ``GROUP`` columns (a divisor of ``BLOCK``; ``BLOCK`` itself for a whole row that fits): each ``BLOCK`` of the
    products once, its groups' scales and codes."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    if GROUP > 0:
        for c in range(0, n, BLOCK):
            col = c + tl.arange(0, BLOCK)
            products = _product(x_ptr, row, col, n, col < n, x_ptr.dtype.element_ty)
            store_codes(products, out_ptr + row * n + c, scale_ptr + row * groups + c // GROUP, n - c,
                        groups - c // GROUP, GROUP, BLOCK)
        return
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(0, n, BLOCK):
        col = c + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_product(x_ptr, row, col, n, col < n, x_ptr.dtype.element_ty)))
    scale = e4m3_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, scale)
    for c in range(0, n, BLOCK):
        col = c + tl.arange(0, BLOCK)
        mask = col < n
        codes = e4m3_codes(_product(x_ptr, row, col, n, mask, x_ptr.dtype.element_ty), scale)
        tl.store(out_ptr + row * n + col, codes, mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, e4m3_group: int = 0):
    """``x [T, 2I]`` contiguous → ``[T, I]`` (written into ``out``, contiguous, when given), or with ``e4m3_group`` a
    ``QuantizedRows`` of it, one scale per token and that many columns."""
    t, n = x.shape[0], x.shape[1] // 2
    if e4m3_group:  # one program a row (a row's scale needs all of it), holding as much as the quantization does
        check_group(n, e4m3_group)
        groups = n // e4m3_group
        codes = torch.empty((t, n), dtype=FP8, device=x.device)
        scale = torch.empty((t, groups), dtype=torch.float32, device=x.device)
        block, warps = row_launch(n)
        group = e4m3_group if groups > 1 else block if n <= block else 0  # a row that fits is read once
        _silu_and_mul_e4m3_kernel[(t,)](x, codes.view(torch.uint8), scale, n, groups, GROUP=group, BLOCK=block,
                                        num_warps=warps, **pdl_args(x.device))
        return QuantizedRows(codes, scale, x.dtype)
    block = min(BLOCK, triton.next_power_of_2(n))
    out = torch.empty((t, n), dtype=x.dtype, device=x.device) if out is None else out
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, BLOCK=block, **pdl_args(x.device))
    return out
