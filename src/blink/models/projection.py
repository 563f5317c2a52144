"""``Projection``: one GEMM operand of the model step (a projection, or the stacked projections of the experts).

``weight [(E,) N, K]`` is in the model dtype, or e4m3 with its float32 scales beside it under the checkpoint's name
(``Fp8Config.scale_name``: ``weight_scale`` per row, ``weight_scale_inv`` per block), so checkpoint tensors and
parameters keep one name. A model-dtype projection calls ``ops.linear`` (on CUDA the skinny GEMM at decode-sized
steps, else ``F.linear``); an FP8 one calls ``ops.fp8_linear`` (``scaled_mm`` / the block-scale kernel on CUDA,
dequantize-then-matmul on the CPU).
"""
from __future__ import annotations

import torch
from torch import nn

from blink.errors import ConfigError

from .e4m3 import FP8, quantize_blocks, quantize_rows
from .quantization import SCALED_MM_MULTIPLE, Fp8Config


def parameter(*shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Projection(nn.Module):
    """``rows x cols`` weights (``experts`` of them stacked when > 0), FP8 when ``quant`` is given."""

    def __init__(self, rows: int, cols: int, quant: Fp8Config | None = None, experts: int = 0, *, device, dtype):
        super().__init__()
        if quant is not None:
            _check_fp8_shape(rows, cols, quant)
        self.lead = (experts,) if experts else ()
        self.weight = parameter(*self.lead, rows, cols, device=device, dtype=FP8 if quant else dtype)
        self.quant = quant
        if quant is not None:
            setattr(self, quant.scale_name, parameter(*self.lead, *quant.scale_shape(rows, cols), device=device,
                                                      dtype=torch.float32))

    @property
    def scale(self) -> torch.Tensor | None:
        return None if self.quant is None else getattr(self, self.quant.scale_name)

    @property
    def block(self) -> tuple[int, int] | None:
        return None if self.quant is None else self.quant.weight_block_size

    def forward(self, x, ops) -> torch.Tensor:
        """``x``: activations, or ``QuantizedRows`` for an FP8 projection that asks for them so (``e4m3_group``)."""
        if self.quant is None:
            return ops.linear(x, self.weight)
        return ops.fp8_linear(x, self.weight, self.scale, self.block)

    def e4m3_group(self, rows: int, ops) -> int:
        """How the kernel before this projection should hand it ``rows`` activations: quantized with one scale per
        token and this many columns (its input width, or a weight block's), or 0, as they are
        (``ops.fp8_takes_e4m3``)."""
        if self.quant is None or not ops.fp8_takes_e4m3(rows, self.block):
            return 0
        return self.weight.shape[-1] if self.block is None else self.block[1]

    @torch.no_grad()
    def quantize_(self, quant: Fp8Config) -> None:
        """Replace the model-dtype weights by e4m3 ones with ``quant``'s scales (``--quantization fp8``; random
        FP8 models), freeing the originals."""
        assert self.quant is None, "already quantized"
        weight, self.weight = self.weight, None
        block = quant.weight_block_size
        q, scale = quantize_rows(weight) if block is None else quantize_blocks(weight, block)
        del weight
        self.weight = nn.Parameter(q, requires_grad=False)
        setattr(self, quant.scale_name, nn.Parameter(scale, requires_grad=False))
        self.quant = quant


def _check_fp8_shape(rows: int, cols: int, quant: Fp8Config) -> None:
    """The kernels' shape rules: ``torch._scaled_mm`` takes ``N`` and ``K`` in multiples of 16; the block kernel
    quantizes activations in whole groups of ``bk`` columns."""
    block = quant.weight_block_size
    if block is None and (rows % SCALED_MM_MULTIPLE or cols % SCALED_MM_MULTIPLE):
        raise ConfigError(f"FP8 weights of {rows} x {cols}: per-channel FP8 GEMMs (torch._scaled_mm) need both "
                          f"dimensions multiples of {SCALED_MM_MULTIPLE}")
    if block is not None and cols % block[1]:
        raise ConfigError(f"quantization_config.weight_block_size {list(block)}: a projection of {cols} input "
                          f"columns is not whole blocks of {block[1]}")
