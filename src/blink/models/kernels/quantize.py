"""Activations to e4m3 per token (or per token and ``group`` columns) in one kernel; reference:
``e4m3.quantize_activations`` (the same scales and values, bit for bit).

An FP8 GEMM of more than a decode step's rows quantizes its activations first. As torch ops that is eight kernels per
projection (cast, abs, amax, clamp, two divisions, clamp, cast), ~1.8 ms of a Qwen3-8B step on the H200; here it is
one launch: each program reads its group twice (the amax, then the scaled values), from L2 the second time.

The values are rounded to e4m3 in float32 (``_round_to_e4m3``: nearest, ties to even, as torch's cast) before the
cast, which is then exact. Triton's interpreter casts float32 to e4m3 with ties away from zero and loses the carry
into the exponent (126 → 64), so a plain cast could not be checked on the CPU; the rounding makes both paths agree.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import FP8, FP8_MAX, MIN_AMAX
from .pdl import pdl_args, wait_for_previous

CHUNK = 1024  # columns a program holds at once; a longer group is read in steps of this many
SMALLEST_NORMAL = tl.constexpr(2.0 ** -6)  # e4m3's; below it the values are whole multiples of SUBNORMAL_STEP
SUBNORMAL_STEP = tl.constexpr(2.0 ** -9)


@triton.jit
def _round_to_e4m3(y):
    """``y`` (float32, ``|y| <= FP8_MAX``) rounded to the nearest e4m3 value, ties to even, still float32.

    A normal value keeps 3 mantissa bits: add half a step less one, plus the kept part's lowest bit (ties to even),
    and clear the 20 dropped bits; a carry moves into the exponent as it should. A subnormal one is a whole number of
    2^-9 steps: its floor and the remainder are exact in float32, so the tie test is too (an addition that shifted it
    into the normals would round away the bits that tell a near-tie from a tie)."""
    mag = tl.abs(y)
    bits = mag.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    steps = mag * (1.0 / SUBNORMAL_STEP)  # exact: a power of two
    whole = tl.floor(steps)
    rest = steps - whole
    up = (rest > 0.5) | ((rest == 0.5) & ((whole.to(tl.int32) & 1) == 1))
    subnormal = (whole + up.to(tl.float32)) * SUBNORMAL_STEP
    rounded = tl.where(mag < SMALLEST_NORMAL, subnormal, normal)
    return tl.where(y < 0, -rounded, rounded)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, x_stride, k, group, groups, FP8_MAX: tl.constexpr,
                     MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(token, g)``: ``scale[token, g] = max(amax, MIN_AMAX) / FP8_MAX`` over the token's columns
    ``[g * group, (g + 1) * group)``, and ``out = e4m3(clamp(x / scale))`` there; ``out`` ``[m, k]`` contiguous."""
    token, g = tl.program_id(0), tl.program_id(1)
    first = g * group
    x_row = x_ptr + token.to(tl.int64) * x_stride
    wait_for_previous(PDL)
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(first, first + group, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < first + group, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
    tl.store(scale_ptr + token * groups + g, scale)
    out_row = out_ptr + token.to(tl.int64) * k
    for c in range(first, first + group, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        ok = cols < first + group
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_row + cols, _round_to_e4m3(y).to(out_ptr.dtype.element_ty), mask=ok)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (unit stride in K) → (e4m3 ``[M, K]``, float32 scales ``[M, K / group]``): each row's ``group``
    consecutive columns scaled so that their largest magnitude is ``FP8_MAX`` (``group = K``: one scale per
    token)."""
    m, k = x.shape
    if k % group or x.stride(1) != 1:
        raise ValueError(f"quantize_activations: {k} columns in groups of {group} with unit stride "
                         f"(got stride {x.stride(1)})")
    groups = k // group
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    _quantize_kernel[(m, groups)](x, out, scale, x.stride(0), k, group, groups, FP8_MAX=FP8_MAX,
                                  MIN_AMAX=MIN_AMAX, BLOCK=min(CHUNK, triton.next_power_of_2(group)),
                                  **pdl_args(x.device))
    return out, scale
