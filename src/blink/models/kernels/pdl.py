"""Programmatic dependent launch (PDL) for the model step's Triton kernels.

Launched with PDL, a kernel may be placed on the SMs as the kernel before it in the stream finishes, before that
kernel's completion is processed; its programs then wait (``wait_for_previous``: PTX ``griddepcontrol.wait``) until
that kernel's writes are visible. What a program does before the wait (address arithmetic, reads of step buffers)
overlaps the previous kernel's tail. Captured into a CUDA graph the launches become programmatic edges; such a graph
instantiates for device launch (``bench/decode_chain_bench.py``) and the engine's GPU tests run it so.

Apart from ``gemv`` (below), the kernels do not trigger their dependents early (``gdc_launch_dependents``): on the
H200 that made Qwen3-30B-A3B's batch-1 decode step 4% slower (3.757 -> 3.906 ms) though batches 16-64 gained ~1.3%;
placed at completion, batch 1 gained 0.8% and no cell lost beyond noise (docs/benchmarks/models.md,
"Programmatic dependent launch"). Triggered at the start of only the kernels before the FP8 projections (norms,
SiLU, RoPE, attention), the Qwen3-8B FP8 step on an H100 took 10% longer at batches 1 and 16 (4.82 against 4.35
ms), with or without the projections asking L2 for their first weight lines before the wait; triggered by the
norms, SiLU and attention's merge right after their own wait, with the skinny GEMM loading its first two weight
tiles into registers before its wait, 17% longer at batch 1 (4.60 against 3.94 ms; docs/benchmarks/experiments.md,
"Weights asked of L2 before the PDL wait"). Triggered right after every kernel's wait, beside ``gemv``, Qwen3-0.6B's
step on an H200 took 0.893 / 0.903 ms at one row against ``gemv`` alone's 0.908 / 0.905, and 1.460 / 1.412 at 16 rows
against 1.396 / 1.361 (raw ``bench/results/gemv_step_h200_856d13f.json``): not taken.

The one kernel that triggers is ``gemv`` (one row of a small projection): it triggers as it starts and copies its
first weight tiles into shared memory before its wait, so the kernel after it is placed early; that took Qwen3-0.6B's
one-row step from 1.064 to 0.906 ms on the H200 (its docstring).

Invariants every step kernel keeps:

- What a program reads before it waits is never written by the step's own kernels: only weights, and the step
  buffers filled before the step (positions, query start locations, sequence lengths, block tables).
  Activations, the KV cache and anything a torch op computes inside the step are read after the wait.
- Every program waits, before any early return. A kernel then never finishes before the kernels ahead of it, so a
  later kernel that waits only for its predecessor has also waited for all of them.

``BLINK_PDL=0`` launches plainly (for comparison, or a driver that misbehaves). Triton's interpreter has no
``griddepcontrol``, so off CUDA (and before Hopper) the wait is compiled out and launches are plain.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Waits for the previous kernel's writes to be visible (no-op unless ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: CUDA of compute capability >= 9 and ``BLINK_PDL`` not ``0``."""
    if device.type != "cuda" or os.environ.get("BLINK_PDL", "1") == "0":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """The keyword arguments that launch a step kernel on ``device``: its ``PDL`` constexpr and Triton's
    ``launch_pdl``, both on or both off."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}
