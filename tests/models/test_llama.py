"""Llama specifics: llama3 RoPE scaling; GQA with a single KV head."""
import torch

from blink.models import load_model
from tests.models.harness import check_mixed_batches

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def test_llama3_rope_scaling_matches_transformers(hf_checkpoint):
    hf_model, path = hf_checkpoint("LlamaForCausalLM", rope_parameters=LLAMA3_ROPE)
    model = load_model(path, dtype=torch.float32)
    assert model.config.rope_scaling.factor == 4.0
    check_mixed_batches(model, hf_model)


def test_multi_query_attention(hf_checkpoint):
    hf_model, path = hf_checkpoint("LlamaForCausalLM", num_key_value_heads=1)
    check_mixed_batches(load_model(path, dtype=torch.float32), hf_model, seed=2)
