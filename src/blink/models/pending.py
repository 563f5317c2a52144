"""Input rows a projection's kernel computes as it reads them, in place of the kernel that would have stored them
first: an RMSNorm's output (``NormedRow``) and SiLU-and-multiply's (``GatedRow``).

The decoder hands a projection one of these where ``ops.linear_takes_pending`` says its ``ops.linear`` computes it
(on CUDA: a one-row projection by the GEMV, ``kernels.gemv``), so the step launches one kernel fewer and the
projection follows the projection before it in the PDL chain directly. Their values are those ``ops.rms_norm`` and
``ops.silu_and_mul`` would have stored (the same bf16 roundings)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class NormedRow(NamedTuple):
    """``ops.rms_norm(h, weight, eps, residual)``'s normed row; the kernel that computes it also stores ``h +
    residual`` (rounded to bf16) into ``total``, which ``of`` returns as the next residual, as ``rms_norm`` does."""

    h: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    total: torch.Tensor

    @classmethod
    def of(cls, h: torch.Tensor, weight: torch.Tensor, eps: float,
           residual: torch.Tensor) -> tuple[NormedRow, torch.Tensor]:
        """The pending row and the next residual (written when the row's projection runs), as ``ops.rms_norm``
        returns its normed rows and their sum."""
        total = torch.empty_like(h)
        return cls(h, residual, weight, eps, total), total


class GatedRow(NamedTuple):
    """``ops.silu_and_mul(gate_up)``'s row: ``silu(gate) * up`` of ``gate_up = [gate | up]``."""

    gate_up: torch.Tensor
