"""Fused RMSNorm (+ residual add) in Triton; reference: ``reference.rms_norm``. With ``e4m3_group`` the normalised rows
come out quantized per token and that many columns (``QuantizedRows``), as ``kernels.quantize`` would quantize them:
the input of an FP8 projection, without a launch of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import FP8, QuantizedRows
from .pdl import pdl_args, wait_for_previous
from .quantize import check_group, store_codes


@triton.jit
def _rms_norm_kernel(x_ptr, stride_xt, stride_xh, res_ptr, sum_ptr, out_ptr, scale_ptr, w_ptr, rows_ptr, heads, n,
                     groups, eps, HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)  # one row = one (token, head) of the output; sum and out are contiguous
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    # A step buffer (read before the wait); int64: a row of an embedding table may lie past 2**31 elements.
    src = tl.maximum(tl.load(rows_ptr + t), 0).to(tl.int64) if GATHER else t
    wait_for_previous(PDL)
    x = tl.load(x_ptr + src * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the residual is contiguous
        x = (x.to(tl.float32) + tl.load(res_ptr + (src * heads + h) * n + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)  # HF rounds the sum to the model dtype before normalising
    if HAS_RESIDUAL or GATHER:  # the sum, or the row taken, as a contiguous output
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    out = (w * normed.to(x.dtype).to(tl.float32)).to(x.dtype)
    if GROUP > 0:  # the row as the model-dtype output would be, quantized per GROUP columns (out_ptr: bytes)
        store_codes(out.to(tl.float32), out_ptr + row * n, scale_ptr + row * groups, n, groups, GROUP, BLOCK)
    else:
        tl.store(out_ptr + row * n + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             e4m3_group: int = 0, rows: torch.Tensor | None = None):
    """``x`` is ``[T, N]`` or ``[T, H, N]`` (any stride but unit stride in N); returns contiguous outputs, the normed
    one a ``QuantizedRows`` with ``e4m3_group`` (``[T, N]`` only; one scale per token and that many columns). With
    ``rows`` (int), as the reference: the outputs' tokens are those rows of ``x`` and ``residual``."""
    x3 = x if x.dim() == 3 else x[:, None, :]
    _, heads, n = x3.shape
    t = x3.shape[0] if rows is None else rows.shape[0]
    out_shape = (t, *x.shape[1:])
    block = triton.next_power_of_2(n)
    if e4m3_group:
        check_group(n, e4m3_group)
        if heads != 1:
            raise ValueError("rms_norm quantizes rows of [T, N] only (per token), not heads of [T, H, N]")
    groups = n // e4m3_group if e4m3_group else 0
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm reads the residual as contiguous rows: pass residual.contiguous()")
    out = torch.empty(out_shape, dtype=FP8 if groups else x.dtype, device=x.device)
    scale = torch.empty((t, groups), dtype=torch.float32, device=x.device) if groups else out
    total = torch.empty(out_shape, dtype=x.dtype, device=x.device) if residual is not None or rows is not None else None
    _rms_norm_kernel[(t * heads,)](x3, x3.stride(0), x3.stride(1), residual if residual is not None else x,
                                   total if total is not None else x, out.view(torch.uint8) if groups else out, scale,
                                   weight, rows if rows is not None else x, heads, n, groups, eps,
                                   HAS_RESIDUAL=residual is not None, GATHER=rows is not None,
                                   GROUP=0 if not groups else block if groups == 1 else e4m3_group, BLOCK=block,
                                   **pdl_args(x.device))
    normed = QuantizedRows(out, scale, x.dtype) if groups else out
    return normed, total if total is not None else x
