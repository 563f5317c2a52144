"""The arithmetic of e4m3 weights and activations with float32 scales (the layouts: ``quantization.py``)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0       # the largest finite e4m3 value
MIN_AMAX = 1e-12      # a row of zeros gets this amax, not a zero scale (its quantized values are 0 either way)


class QuantizedRows(NamedTuple):
    """Activations already in e4m3, as the kernel that produced them quantized them per token and group of columns
    (``values [M, K]``, float32 ``scales [M, K / group]``: ``[M, 1]`` for one scale a token), standing for ``dtype``
    ones: an FP8 projection takes them as they are (``ops.fp8_takes_e4m3``), per token with per-row weight scales,
    per token and weight block's columns with block scales."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def dequantized(self) -> torch.Tensor:
        grouped = self.values.float().unflatten(-1, (self.scales.shape[-1], -1))
        return (grouped * self.scales[..., None]).flatten(-2).to(self.dtype)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` → (e4m3 ``[..., N, K]``, float32 scales ``[..., N]``): each row scaled so that its largest
    magnitude is ``FP8_MAX`` (``--quantization fp8``, vLLM's per-channel dynamic scheme)."""
    scale = w.float().abs().amax(-1).clamp(min=MIN_AMAX) / FP8_MAX
    return (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (e4m3 ``[M, K]``, float32 scales ``[M, K / group]``): each row's ``group`` consecutive columns
    scaled so that their largest magnitude is ``FP8_MAX`` (``group = K``: one scale per token). The reference of
    ``kernels.quantize``, which the step runs."""
    xf = x.float().unflatten(-1, (-1, group))
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2), scale.squeeze(-1)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` → (e4m3 ``[..., N, K]``, float32 scales ``[..., ceil(N/bn), ceil(K/bk)]``): each ``block``
    scaled so that its largest magnitude is ``FP8_MAX`` (random FP8 models of the block layout)."""
    (bn, bk), (rows, cols) = block, w.shape[-2:]
    padded = F.pad(w.float().abs(), (0, -cols % bk, 0, -rows % bn))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    scale = tiles.amax(-1).amax(-2).clamp(min=MIN_AMAX) / FP8_MAX
    return (w.float() / _per_element(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """e4m3 ``weight [..., N, K]`` times its scales (per row ``[..., N]``, or per ``block`` ``[..., N/bn, K/bk]``),
    in float32."""
    if block is None:
        return weight.float() * scale[..., None]
    return weight.float() * _per_element(scale, block, *weight.shape[-2:])


def _per_element(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Block scales ``[..., ceil(rows/bn), ceil(cols/bk)]`` repeated over their blocks: ``[..., rows, cols]``."""
    return scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
