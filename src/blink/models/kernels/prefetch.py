"""L2 prefetch of a weight on a side branch of the step; reference: ``reference.l2_prefetch`` (nothing to do).

A decode step at small batches streams its weights at the HBM rate in the GEMMs, but between them runs kernels that
barely touch memory (RoPE, attention over a short context, the split-KV combine, RMSNorm): HBM idles there.
``l2_prefetch(weights)`` forks a side stream that issues bulk L2 prefetches (PTX ``cp.async.bulk.prefetch.L2``,
Hopper's TMA: one instruction per ``CHUNK`` bytes, nothing waits for the data) for up to ``max_bytes`` of
``weights``, in order, and joins it when the ``with`` block ends; the GEMM after the block then reads those bytes
from L2. Captured into a CUDA graph the fork and join become a parallel branch, so the prefetch runs beside the
block's kernels. A prefetch changes no value: it is a cache hint, safe on read-only weights.

``BLINK_L2_PREFETCH=0`` turns it off (for comparison).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes per bulk prefetch: a multiple of 16, as the instruction requires
LANES = 32  # prefetches per program: one warp, one each


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    # Lanes past the end have size <= 0 and issue nothing.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_lines_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):  # experiment
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    for line in range(0, CHUNK, 128):
        size = (nbytes - offs - line).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [base + offs + line, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_touch_kernel(ptr, sink_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # experiment
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    total = tl.reduce(acc, 0, _xor)
    tl.store(sink_ptr, total, mask=total == 0x5EED1234)  # never true in practice: keeps the loads alive


@triton.jit
def _xor(a, b):
    return a ^ b


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


def prefetch_enabled(device: torch.device) -> bool:
    """Whether ``l2_prefetch`` prefetches on ``device``: CUDA of compute capability >= 9 (TMA) and
    ``BLINK_L2_PREFETCH`` not ``0``."""
    if device.type != "cuda" or os.environ.get("BLINK_L2_PREFETCH", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def _issue(weight: torch.Tensor, nbytes: int) -> None:
    method = os.environ.get("BLINK_L2_PREFETCH_METHOD", "bulk")
    grid = (triton.cdiv(nbytes, CHUNK * LANES),)
    if method == "bulk":
        _l2_prefetch_kernel[grid](weight.data_ptr(), nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)
    elif method == "lines":
        _l2_prefetch_lines_kernel[grid](weight.data_ptr(), nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)
    else:
        words = weight.view(-1).view(torch.int32)
        block, iters = 1024, 16
        _l2_touch_kernel[(triton.cdiv(nbytes // 4, block * iters),)](words, _sink(weight.device), nbytes // 4,
                                                                    BLOCK=block, ITERS=iters, num_warps=4)


@functools.lru_cache(maxsize=None)
def _sink(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


@contextlib.contextmanager
def l2_prefetch(weights: list[torch.Tensor], max_bytes: int):
    """Prefetches the first ``max_bytes`` of ``weights`` (contiguous, in list order) into L2 beside the ``with``
    block's kernels; the current stream waits for the side branch when the block ends."""
    device = weights[0].device
    if max_bytes < 16 or not prefetch_enabled(device):
        yield
        return
    main, side = torch.cuda.current_stream(device), _side_stream(device.index or 0)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        left = max_bytes
        for w in weights:
            if left < 16:
                break
            if not w.is_contiguous():
                raise ValueError(f"l2_prefetch needs contiguous weights (got strides {w.stride()})")
            nbytes = min(w.numel() * w.element_size(), left) // 16 * 16
            _issue(w, nbytes)
            left -= nbytes
    yield
    main.wait_stream(side)
