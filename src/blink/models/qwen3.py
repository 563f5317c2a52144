"""``Qwen3ForCausalLM``: Llama's layout plus an RMSNorm over each query and key head before RoPE."""
from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = True
