"""``LlamaForCausalLM`` (Llama 2/3/3.1 incl. llama3 RoPE scaling, SmolLM2): separate q/k/v and gate/up tensors in
the checkpoint, fused at load time."""
from __future__ import annotations

from .decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
