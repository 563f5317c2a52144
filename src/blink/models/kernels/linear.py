"""A model-dtype projection's GEMM by rows: decode-sized steps by the skinny GEMM (``skinny``), larger ones by
cuBLAS (``F.linear``).

Up to ``SKINNY_UP_TO`` rows a projection streams its weights once and its time is their bytes plus the kernel's ramp.
For a small model's projections (a few MB) the ramp is most of it, and cuBLAS's launch shapes there leave SMs idle:
Qwen3-0.6B's qkv projection (4096 x 1024) took 12.5 us at one row on the H200 for 8.4 MB (2 us of bytes). The skinny
GEMM also waits in the step's programmatic-dependent-launch chain (``pdl``), which cuBLAS's kernels do not. Beyond
``SKINNY_UP_TO`` rows cuBLAS's tensor-core tiles win.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .skinny import skinny_linear

SKINNY_UP_TO = 16


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` in ``x.dtype`` (the model dtype of both)."""
    if x.shape[0] <= SKINNY_UP_TO:
        return skinny_linear(x, weight)
    return F.linear(x, weight)
