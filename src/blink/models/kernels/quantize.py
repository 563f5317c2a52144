"""Activations to e4m3 per token (or per token and ``group`` columns) in one kernel; reference:
``e4m3.quantize_activations`` on the CPU (the same scales and codes, bit for bit).

An FP8 GEMM of more than a decode step's rows quantizes its activations first. As torch ops that is eight kernels per
projection (cast, abs, amax, clamp, two divisions, clamp, cast); here it is one launch: each program reads its group
twice (the amax, then the scaled values), from cache the second time, in steps of up to ``CHUNK`` columns.

The kernel writes each value's e4m3 code itself (``e4m3_code``: nearest, ties to even, as torch's cast) rather than
casting: Triton's interpreter casts float32 to e4m3 with ties away from zero, and a mantissa that rounds past its top
bit does not raise the exponent (126 → 64), so a cast could not be checked on the CPU. Its divisions are correctly
rounded (``div_rn``), as torch's are on the CPU; torch on CUDA multiplies by a scalar divisor's reciprocal instead, so
the reference runs on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import FP8, FP8_MAX, MIN_AMAX
from .pdl import pdl_args, wait_for_previous

CHUNK = 16384  # columns a program holds at once (32 registers a thread at 16 warps); a longer group is read in steps
LARGEST = tl.constexpr(FP8_MAX)
SMALLEST_AMAX = tl.constexpr(MIN_AMAX)
SMALLEST_NORMAL = tl.constexpr(2.0 ** -6)  # e4m3's; below it the values are whole multiples of SUBNORMAL_STEP
SUBNORMAL_STEP = tl.constexpr(2.0 ** -9)
EXPONENT_REBIAS = tl.constexpr((127 - 7) << 3)  # float32's exponent bias to e4m3's, above 3 mantissa bits


@triton.jit
def e4m3_code(y):
    """The e4m3 code (int32 in [0, 255]) of float32 ``y``, ``|y| <= FP8_MAX``: nearest, ties to even.

    A normal value keeps 3 mantissa bits: add half a step less one, plus the kept part's lowest bit (ties to even), and
    drop the 20 others; a mantissa that rounds past its top bit raises the exponent, as it should, and the exponent is
    rebiased. A subnormal one is a whole number of 2^-9 steps: its floor and the remainder are exact in float32, so the
    tie test is too."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - EXPONENT_REBIAS
    steps = tl.abs(y) * (1.0 / SUBNORMAL_STEP)  # exact: a power of two
    whole = tl.floor(steps)
    rest = steps - whole
    up = (rest > 0.5) | ((rest == 0.5) & ((whole.to(tl.int32) & 1) == 1))
    subnormal = whole.to(tl.int32) + up.to(tl.int32)
    return sign | tl.where(tl.abs(y) < SMALLEST_NORMAL, subnormal, normal)


@triton.jit
def e4m3_scale(amax):
    """The scale of values whose largest magnitude is ``amax``: ``max(amax, MIN_AMAX) / FP8_MAX``, correctly
    rounded as torch's division."""
    return tl.math.div_rn(tl.maximum(amax, SMALLEST_AMAX), LARGEST)


@triton.jit
def e4m3_codes(x, scale):
    """``x`` (float32) over ``scale``, clamped to ±``FP8_MAX``, as e4m3 codes (uint8)."""
    return e4m3_code(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -LARGEST), LARGEST)).to(tl.uint8)


@triton.jit
def store_codes(values, out_ptr, scale_ptr, n, groups, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """``BLOCK`` float32 ``values`` of a row (zero past its ``n`` columns) quantized per ``GROUP`` columns: group
    ``g``'s scale to ``scale_ptr[g]`` for ``g < groups``, the codes to ``out_ptr[:n]`` (uint8). ``GROUP`` divides
    ``BLOCK``; ``GROUP == BLOCK`` quantizes the whole row with one scale."""
    g = tl.arange(0, BLOCK // GROUP)
    grouped = tl.reshape(values, [BLOCK // GROUP, GROUP])
    scale = e4m3_scale(tl.max(tl.abs(grouped), axis=1))
    tl.store(scale_ptr + g, scale, mask=g < groups)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(out_ptr + cols, e4m3_codes(grouped, scale[:, None]), mask=cols < n)


def check_group(n: int, group: int) -> None:
    """A kernel that hands over its rows quantized takes ``group``: ``n`` (one scale a row) or a power of two of at
    least 16 that divides ``n`` (a weight block's columns)."""
    if group != n and (group < 16 or group & (group - 1) or n % group):
        raise ValueError(f"e4m3_group must be the row's {n} columns or a power of two >= 16 dividing them "
                         f"(got {group!r})")


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, x_stride, k, group, groups, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(token, g)``: ``scale[token, g] = max(amax, MIN_AMAX) / FP8_MAX`` over the token's columns
    ``[g * group, (g + 1) * group)``, and ``out = e4m3(clamp(x / scale))`` there as codes; ``out`` ``[m, k]``
    uint8, contiguous."""
    token, g = tl.program_id(0), tl.program_id(1)
    first = g * group
    x_row = x_ptr + token.to(tl.int64) * x_stride
    wait_for_previous(PDL)
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(first, first + group, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < first + group, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = e4m3_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + token * groups + g, scale)
    out_row = out_ptr + token.to(tl.int64) * k
    for c in range(first, first + group, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        ok = cols < first + group
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + cols, e4m3_codes(x, scale), mask=ok)


def row_launch(n: int) -> tuple[int, int]:
    """The columns a program holds at once and its warps, for programs that each quantize ``n`` columns of a row:
    the whole row up to ``CHUNK`` (read twice, the second time from cache), 32 values a thread."""
    block = min(CHUNK, triton.next_power_of_2(n))
    return block, max(4, min(16, block // 512))


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (e4m3 ``[M, K]``, float32 scales ``[M, K / group]``): each row's ``group`` consecutive columns
    scaled so that their largest magnitude is ``FP8_MAX`` (``group = K``: one scale per token)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"quantize_activations: {k} columns are not whole groups of {group}")
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = k // group
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    block, warps = row_launch(group)
    _quantize_kernel[(m, groups)](x, out.view(torch.uint8), scale, x.stride(0), k, group, groups, BLOCK=block,
                                  num_warps=warps, **pdl_args(x.device))
    return out, scale
