"""A GEMM's reduction split over programs, summed inside the kernel: no zeroed buffer, no cast launch.

A split-K GEMM's parts used to add into a float32 output zeroed first (``torch.zeros``) and be cast to the model
dtype after (``.to``): two launches around each split projection (Qwen3-8B's down projection at decode), neither of
them PDL, so the projection could not start before its predecessor finished. Here each part stores its float32 tile
in ``work [parts, M, N]`` (``torch.empty``: no launch), counts itself in at its tile's counter, and the last part to
arrive adds every part in part order (the sum does not depend on which arrived last) and stores the output.

Invariants:

- A tile's counter is 0 before the kernel and 0 after it: the last part resets it. Each weight has its own
  counters (``tile_counters``, one per output tile of a launch shape), so two models' steps on one GPU, which may
  run at once, never share one; launches of one weight run one after another (a model's steps do), each reading the
  counters only after ``wait_for_previous``. A weight's counters are created by its first launch of that shape,
  which must not be inside a CUDA graph capture: warm up first, as every capture here does.
- The counter's atomic is acq_rel at GPU scope after a barrier of the program, so every part's stores are visible
  to the last part, which reads them past L1 (``.cg``).

Attention's key splits (``attention.py``) keep their merge launch: merged by the last split the same way, the
Qwen3-8B FP8 step on an H100 took 0.1 ms longer at batches 1 and 16 (docs/benchmarks/experiments.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_counters: dict[tuple, torch.Tensor] = {}  # by (device, weight address, tiles)


def tile_counters(weight: torch.Tensor, tiles: int) -> torch.Tensor:
    """The zeroed counters of a split launch of ``tiles`` output tiles over ``weight``. A weight freed and another
    allocated at its address inherit them: zero between launches, they hold nothing of the old one."""
    key = (weight.device, weight.data_ptr(), tiles)
    counters = _counters.get(key)
    if counters is None:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a split GEMM's tile counters are created by its first launch outside graph capture: "
                               "run the step once (warm-up) before capturing it")
        counters = _counters[key] = torch.zeros(tiles, dtype=torch.int32, device=weight.device)
    return counters


def split_buffers(out: torch.Tensor, weight: torch.Tensor, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(work, counters)`` of a launch of ``tiles`` output tiles of the 2-D ``out`` over ``weight`` in ``parts``
    parts: float32 part tiles (uninitialised: every part writes its whole tile) and the tiles' counters; with one
    part, ``out`` twice (the kernel reads neither)."""
    if parts == 1:
        return out, out
    return (torch.empty((parts, *out.shape), dtype=torch.float32, device=out.device),
            tile_counters(weight, tiles))


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
