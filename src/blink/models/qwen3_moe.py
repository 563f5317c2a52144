"""``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; in the layers that
``ModelConfig.is_moe_layer`` picks, a softmax router over ``num_experts`` SiLU experts of which each token uses
``num_experts_per_tok`` (weights renormalised when ``norm_topk_prob``), the other layers dense. Checkpoints hold each
expert's ``gate_proj``, ``up_proj`` and ``down_proj`` separately; the loader stacks them into ``SparseMoE``'s 3-D
parameters, gate and up fused."""
from __future__ import annotations

from .qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Everything MoE comes from the config (``SparseMoE`` layers); names and q/k norm are Qwen3's."""
