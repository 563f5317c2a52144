"""Every family's step against HF transformers on tiny random checkpoints: prefill, chunked prefill and decode mixed
in one padded step, with shuffled page placement; step graphs replayed by device launch, one of them a one-row step
whose projections the GEMV takes."""
import pytest
import torch

from blink.models import load_model
from tests.models.harness import Runner, check_mixed_batches, check_step_graph_device_launch, hf_logits

FAMILIES = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_mixed_batches_match_transformers(arch, hf_checkpoint):
    hf_model, path = hf_checkpoint(arch)
    check_mixed_batches(load_model(path, dtype=torch.float32), hf_model)


@pytest.mark.parametrize("arch", FAMILIES)
def test_tied_embeddings(arch, hf_checkpoint):
    hf_model, path = hf_checkpoint(arch, tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32)
    assert model.lm_head_weight() is model.model.embed_tokens.weight
    check_mixed_batches(model, hf_model, seed=1)


def test_rows_that_sample_nothing_keep_their_outputs(hf_checkpoint):
    _, path = hf_checkpoint("LlamaForCausalLM")
    runner = Runner(load_model(path, dtype=torch.float32))
    runner.buf.sampled_ids.fill_(-7)
    _, ids, _ = runner.step([runner.chunk(0, [1, 2, 3], 0, sample=False), runner.chunk(1, [4, 5], 0)])
    assert ids[0] == -7 and ids[1] != -7


def test_bf16_step_tracks_float32(hf_checkpoint):
    hf_model, path = hf_checkpoint("Qwen3ForCausalLM")
    runner = Runner(load_model(path, dtype=torch.bfloat16))
    logits, _, _ = runner.step([runner.chunk(0, list(range(1, 12)), 0)])
    want = hf_logits(hf_model, list(range(1, 12)))[-1]
    assert (logits[0] - want).norm() / want.norm() < 2e-2


def small_qwen3(hidden_size: int, intermediate_size: int):
    """A three-layer Qwen3 config of 8 query and 2 KV heads of 64 dims, for the GPU's step graphs."""
    from blink.models import ModelConfig

    return ModelConfig("Qwen3ForCausalLM", vocab_size=5000, hidden_size=hidden_size,
                       intermediate_size=intermediate_size, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64,
                       rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=64, max_position_embeddings=4096)


@pytest.mark.gpu
def test_step_graph_captures_and_device_launch_instantiation_replays_bit_identically():
    from blink.models import random_model

    check_step_graph_device_launch(random_model(small_qwen3(256, 512), "cuda"))


@pytest.mark.gpu
def test_one_row_step_graph_with_its_projections_by_the_gemv_replays_by_device_launch():
    from blink.models import random_model
    from blink.models.kernels.gemv import gemv_takes

    model = random_model(small_qwen3(512, 1024), "cuda", dtype=torch.bfloat16)     # every K a GEMV takes: >= 512
    row = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)
    assert all(gemv_takes(row[:, :p.weight.shape[1]], p.weight) for layer in model.model.layers
               for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    check_step_graph_device_launch(model, bucket=1)
