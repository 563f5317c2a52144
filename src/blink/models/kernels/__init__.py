"""Kernels of the model step. ``ops_for(device)`` picks the implementation: Triton on CUDA, the torch references
(``reference.py``) elsewhere. Both modules expose the same functions with the same signatures."""
from __future__ import annotations

import torch

OPS = ("rms_norm", "silu_and_mul", "rope_kv_write", "attention_plan", "attention", "top_candidates",
       "sampling_params", "row_logsumexp", "candidate_threshold", "gumbel_argmax", "store_sampled", "fused_moe",
       "apply_penalties", "apply_logit_bias", "apply_grammar", "record_tokens", "fp8_linear", "fp8_takes_e4m3",
       "linear")


def ops_for(device):
    if torch.device(device).type == "cuda":
        from . import triton_ops as ops
    else:
        from . import reference as ops
    return ops
