"""A GEMM's reduction split over programs, summed inside the kernel: no zeroed buffer, no cast launch.

A split-K GEMM's parts used to add into a float32 output zeroed first (``torch.zeros``) and be cast to the model
dtype after (``.to``): two launches around each split projection (Qwen3-8B's down projection at decode), neither of
them PDL, so the projection could not start before its predecessor finished. Here each part stores its float32 tile
in ``work [parts, M, N]`` (``torch.empty``: no launch), counts itself in at its tile's counter, and the last part to
arrive adds every part in part order (the sum does not depend on which arrived last) and stores the output.

Invariants:

- A tile's counter is 0 before the kernel and 0 after it: the last part resets it. The counters are one buffer
  per device (``tile_counters``), created by the first launch, which must not be inside a CUDA graph capture
  (warm-up runs first), and shared by every split launch: kernels that use them run one after another, each
  reading them only after ``wait_for_previous``.
- The counter's atomic is acq_rel at GPU scope after a barrier of the program, so every part's stores are visible
  to the last part, which reads them past L1 (``.cg``).

Attention's key splits (``attention.py``) keep their merge launch: merged by the last split the same way, the
Qwen3-8B FP8 step on an H100 took 0.1 ms longer at batches 1 and 16 (docs/benchmarks/experiments.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILES = 1 << 14  # output tiles a split launch may have: 64 KiB of counters a device

_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's zeroed tile counters, of which a launch of ``tiles`` output tiles uses the first ``tiles``."""
    if tiles > MAX_TILES:
        raise ValueError(f"a split-K launch of {tiles} output tiles exceeds MAX_TILES ({MAX_TILES}): use larger tiles")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # one buffer per GPU, however it is named
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K tile counters are created by a first launch outside graph capture: "
                               "run the step once (warm-up) before capturing it")
        counters = _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def split_buffers(out: torch.Tensor, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(work, counters)`` of a launch of ``tiles`` output tiles of the 2-D ``out`` in ``parts`` parts: float32 part
    tiles (uninitialised: every part writes its whole tile) and the tiles' counters; with one part, ``out`` twice
    (the kernel reads neither)."""
    if parts == 1:
        return out, out
    return torch.empty((parts, *out.shape), dtype=torch.float32, device=out.device), tile_counters(out.device, tiles)


@triton.jit
def last_to_arrive(counter_ptr, PARTS: tl.constexpr):
    """Counts this program in at ``counter_ptr``: true in the last of the ``PARTS`` programs to arrive, which sees
    every program's stores made before they arrived, and has reset the counter to 0."""
    tl.debug_barrier()  # every thread's stores made before the program counts itself in
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == PARTS - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def store_split(acc, out_ptr, work_ptr, counter_ptr, offsets, mask, part, part_stride, SPLIT_K: tl.constexpr):
    """Stores ``acc`` (float32) at ``out_ptr + offsets`` in the output's dtype: directly with one part, else as part
    ``part`` of the tile at ``work_ptr + part * part_stride + offsets``; the tile's last part to arrive at
    ``counter_ptr`` sums the parts in order and stores that."""
    if SPLIT_K == 1:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(work_ptr + part.to(tl.int64) * part_stride + offsets, acc, mask=mask)
        if last_to_arrive(counter_ptr, SPLIT_K):
            total = tl.zeros(acc.shape, tl.float32)
            for p in tl.static_range(SPLIT_K):
                total += tl.load(work_ptr + p * part_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
