"""Phi-3 specifics: fused checkpoint tensors, partial rotary dims (Phi-4-mini) and a sliding window shorter than
the test sequences."""
import torch

from blink.models import load_model
from tests.models.harness import check_mixed_batches


def test_partial_rotary_and_sliding_window_match_transformers(hf_checkpoint):
    hf_model, path = hf_checkpoint("Phi3ForCausalLM", partial_rotary_factor=0.5, sliding_window=6)
    model = load_model(path, dtype=torch.float32)
    assert model.config.rotary_dim == 8 and model.config.sliding_window == 6
    check_mixed_batches(model, hf_model)
