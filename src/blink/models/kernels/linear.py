"""A model-dtype projection's GEMM by rows: one row of a small projection by the GEMV that streams its weights through
shared memory and lets the next kernel launch early (``gemv``, Hopper), decode-sized steps by the skinny GEMM
(``skinny``), then up to ``ROWWISE_UP_TO`` rows by the TMA GEMM with the weight rows as the MMA's M (``rowwise``),
larger ones by cuBLAS (``F.linear``).

Up to ``SKINNY_UP_TO`` rows a projection streams its weights once and its time is their bytes plus the kernel's ramp.
The skinny GEMM waits in the step's programmatic-dependent-launch chain (``pdl``) and cuBLAS's kernels do not, so
each cuBLAS projection left a gap in the chain: Qwen3-0.6B's decode step at one row on an H100 had 153 us a step with
no kernel running, 54 us with the skinny GEMM, though its 112 projections took about as long as cuBLAS's (672 against
687 us a step; per call the skinny GEMM is the faster on long reductions, cuBLAS on Qwen3-0.6B's qkv and gate_up).
On the H200 cuBLAS's launch shape for that qkv projection took 12.5 us for 8.4 MB. Beyond ``SKINNY_UP_TO`` rows
cuBLAS's tensor-core tiles win: at 32 and 64 rows on an H100 cuBLAS was the faster on 11 of the 12 projections
``bench/experiments/gemv_bench.py`` runs (Qwen3-8B's gate_up 1-2 % the other way), against a 64-output, 8-warp skinny
launch shape (not swept there). The rowwise GEMM, which waits in the chain as the skinny one does, beat cuBLAS in the
step from 17 to 64 rows (H100, ``model_bench``: Qwen3-0.6B at 32 / 64 rows -6 / -7 %, Qwen3-8B -3.5 / -3.5 %,
Llama-3.2-1B -4 / 0 %); operands TMA cannot read take cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rowwise import rowwise_linear, tma_can_read
from .skinny import skinny_linear

try:
    from .gemv import gemv_takes, launch_gemv
except (ImportError, AttributeError):   # a Triton without Gluon's asynchronous copy: the skinny GEMM takes one row
    gemv_takes = launch_gemv = None

SKINNY_UP_TO = 16
ROWWISE_UP_TO = 64


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` in ``x.dtype`` (the model dtype of both)."""
    if gemv_takes is not None and gemv_takes(x, weight):
        return launch_gemv(x, weight)
    if x.shape[0] <= SKINNY_UP_TO:
        return skinny_linear(x, weight)
    if x.shape[0] <= ROWWISE_UP_TO and tma_can_read(x, weight):
        return rowwise_linear(x, weight)
    return F.linear(x, weight)
