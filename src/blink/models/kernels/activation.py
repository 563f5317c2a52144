"""SiLU-and-mul in Triton; reference: ``reference.silu_and_mul``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n
    gate = tl.load(x_ptr + row * 2 * n + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + col, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, 2I]`` contiguous → ``[T, I]`` (written into ``out``, contiguous, when given)."""
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device) if out is None else out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, BLOCK=block, **pdl_args(x.device))
    return out
