"""Fused RMSNorm (+ residual add) in Triton; reference: ``reference.rms_norm``. With ``e4m3`` the normalised rows
come out quantized per token (``QuantizedRows``), as ``kernels.quantize`` would quantize them: the input of an FP8
projection, without a launch of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import FP8, QuantizedRows
from .pdl import pdl_args, wait_for_previous
from .quantize import e4m3_codes, e4m3_scale


@triton.jit
def _rms_norm_kernel(x_ptr, stride_xt, stride_xh, res_ptr, sum_ptr, out_ptr, scale_ptr, w_ptr, heads, n, eps,
                     HAS_RESIDUAL: tl.constexpr, E4M3: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)  # one row = one (token, head); residual, sum and out are contiguous
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    wait_for_previous(PDL)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)  # HF rounds the sum to the model dtype before normalising
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    out = (w * normed.to(x.dtype).to(tl.float32)).to(x.dtype)
    if E4M3:  # the row as the model-dtype output would be, quantized (out_ptr: bytes)
        scale = e4m3_scale(tl.max(tl.where(mask, tl.abs(out.to(tl.float32)), 0.0), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * n + cols, e4m3_codes(out.to(tl.float32), scale), mask=mask)
    else:
        tl.store(out_ptr + row * n + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             e4m3: bool = False):
    """``x`` is ``[T, N]`` or ``[T, H, N]`` (any stride but unit stride in N); returns contiguous outputs, the normed
    one a ``QuantizedRows`` with ``e4m3`` (``[T, N]`` only)."""
    x3 = x if x.dim() == 3 else x[:, None, :]
    t, heads, n = x3.shape
    if e4m3 and heads != 1:
        raise ValueError("rms_norm quantizes rows of [T, N] only (per token), not heads of [T, H, N]")
    out = torch.empty(x3.shape, dtype=FP8 if e4m3 else x.dtype, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device) if e4m3 else out
    total = torch.empty(x3.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    _rms_norm_kernel[(t * heads,)](x3, x3.stride(0), x3.stride(1), residual if residual is not None else x, total,
                                   out.view(torch.uint8) if e4m3 else out, scale, weight, heads, n, eps,
                                   HAS_RESIDUAL=residual is not None, E4M3=e4m3, BLOCK=triton.next_power_of_2(n),
                                   **pdl_args(x.device))
    normed = QuantizedRows(out.view(x.shape), scale, x.dtype) if e4m3 else out.view(x.shape)
    return normed, total.view(x.shape) if residual is not None else x
