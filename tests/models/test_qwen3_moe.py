"""Qwen3-MoE against HF transformers on tiny random checkpoints: the router (softmax, top-k, ``norm_topk_prob``),
experts stacked from per-expert checkpoint tensors, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step``
put them; prefill, chunked prefill and decodes mixed in one padded step over shuffled pages, greedy continuations,
and the same tokens through the Engine."""
import random

import pytest
import torch

from blink.models import load_model
from blink.models.decoder import SparseMoE
from tests.models.harness import (check_cpu_engine_greedy, check_mixed_batches, check_step_graph_device_launch,
                                  greedy_continuations, hf_greedy)

ARCH = "Qwen3MoeForCausalLM"
SHAPES = {
    "8-experts-top-2": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    "128-experts-top-8": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=16, norm_topk_prob=True),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_mixed_batches_match_transformers(shape, hf_checkpoint):
    hf_model, path = hf_checkpoint(ARCH, **SHAPES[shape])
    model = load_model(path, dtype=torch.float32)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    # blink stacks the experts as transformers does in memory: gate rows, then up rows, per expert
    for ours, theirs in zip(model.model.layers, hf_model.model.layers):
        assert torch.equal(ours.mlp.experts.gate_up_proj.weight, theirs.mlp.experts.gate_up_proj)
        assert torch.equal(ours.mlp.experts.down_proj.weight, theirs.mlp.experts.down_proj)
    check_mixed_batches(model, hf_model)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_continuations_match_transformers(shape, hf_checkpoint):
    hf_model, path = hf_checkpoint(ARCH, **SHAPES[shape])
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (7, 1, 12)]
    ours = greedy_continuations(load_model(path, dtype=torch.float32), prompts, 12)
    for prompt, got in zip(prompts, ours):
        want = hf_greedy(hf_model, prompt, 12)
        assert len(want) == 12 or want[-1] == hf_model.config.eos_token_id
        assert got[:len(want)] == want


def test_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step(hf_checkpoint):
    hf_model, path = hf_checkpoint(ARCH, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                   **dict(SHAPES["8-experts-top-2"], norm_topk_prob=True))
    model = load_model(path, dtype=torch.float32)
    kinds = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert kinds == [hasattr(layer.mlp, "experts") for layer in hf_model.model.layers] == [False, True, False, False]
    check_mixed_batches(model, hf_model, seed=1)


def test_the_engine_serves_it_unchanged(hf_checkpoint):
    hf_model, path = hf_checkpoint(ARCH, **SHAPES["8-experts-top-2"])
    check_cpu_engine_greedy(hf_model, path)


@pytest.mark.gpu
def test_step_graph_captures_and_device_launch_instantiation_replays_bit_identically():
    from blink.models import ModelConfig, random_model

    config = ModelConfig(ARCH, vocab_size=5000, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=8,
                         num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=64,
                         max_position_embeddings=4096, num_experts=64, num_experts_per_tok=8,
                         moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=(1,))
    check_step_graph_device_launch(random_model(config, "cuda"))
