"""RoPE frequency table: ``cos_sin[position] = [cos(position * inv_freq) | sin(position * inv_freq)]``.

Computed in float32 exactly as HF transformers does (the product ``position * inv_freq`` is one rounding either way),
so the rotation matches its reference bit for bit before the cast to the model dtype.
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.rotary_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return freqs
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(config: ModelConfig, device="cpu", max_positions: int | None = None) -> torch.Tensor:
    """``[max_positions, rotary_dim]`` float32 (default: ``max_position_embeddings`` rows)."""
    n = max_positions or config.max_position_embeddings
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq(config)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
