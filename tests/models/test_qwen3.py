"""Qwen3 specifics: per-head q/k RMSNorm with a head_dim that is not hidden_size / heads."""
import torch

from blink.models import load_model
from tests.models.harness import check_mixed_batches


def test_decoupled_head_dim_matches_transformers(hf_checkpoint):
    hf_model, path = hf_checkpoint("Qwen3ForCausalLM", head_dim=32)
    model = load_model(path, dtype=torch.float32)
    assert model.config.head_dim == 32 and model.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    check_mixed_batches(model, hf_model)
