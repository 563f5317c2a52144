"""``Phi3ForCausalLM`` (Phi-3, Phi-4): checkpoints already hold fused ``qkv_proj`` and ``gate_up_proj``; partial
rotary dims and a sliding window come from the config."""
from __future__ import annotations

from .decoder import DecoderLM


class Phi3ForCausalLM(DecoderLM):
    STACKED = {}
