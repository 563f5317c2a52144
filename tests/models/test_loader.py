"""Checkpoint loading: sharded indexes, dtype conversion, fused parameters, random weights, and errors that name
the file and tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blink.models import CheckpointError, ModelConfig, load_model, random_model
from blink.models.loader import checkpoint_targets


def test_sharded_checkpoint_converts_dtype_and_fuses(hf_checkpoint, tmp_path):
    hf_model, _ = hf_checkpoint("LlamaForCausalLM")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = load_model(tmp_path / "sharded", dtype="bfloat16")
    sd = hf_model.state_dict()
    attn = model.model.layers[1].self_attn.qkv_proj.weight
    want = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert attn.dtype == torch.bfloat16 and torch.equal(attn, want.bfloat16())
    for name, target in checkpoint_targets(model).items():
        (index, view), = target.pieces  # unsharded: one piece, the whole tensor
        assert target.shape == sd[name].shape and torch.equal(view, sd[name][index].bfloat16()), name


def test_experts_stack_from_per_expert_tensors(hf_checkpoint):
    _, path = hf_checkpoint("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    tensors = load_file(path / "model.safetensors")
    experts = load_model(path, dtype="bfloat16").model.layers[1].mlp.experts
    per_expert = lambda name: [tensors[f"model.layers.1.mlp.experts.{e}.{name}.weight"] for e in range(4)]  # noqa: E731
    gate_up = torch.stack([torch.cat(pair) for pair in zip(per_expert("gate_proj"), per_expert("up_proj"))])
    assert torch.equal(experts.gate_up_proj.weight, gate_up.bfloat16())
    assert torch.equal(experts.down_proj.weight, torch.stack(per_expert("down_proj")).bfloat16())
    down = "model.layers.1.mlp.experts.2.down_proj.weight"
    save_file(dict(tensors, **{down: tensors[down].T.contiguous()}), path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor {down} has shape \(8, 64\), the config implies \(64, 8\)"):
        load_model(path)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) model.layers.0.mlp.experts.3.up_proj.weight"):
        load_model(path)


def _single_file(hf_checkpoint):
    _, path = hf_checkpoint("Qwen3ForCausalLM")
    return path, path / "model.safetensors", load_file(path / "model.safetensors")


def test_missing_tensor_is_named(hf_checkpoint):
    path, file, tensors = _single_file(hf_checkpoint)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) model.layers.1.self_attn.k_norm.weight"):
        load_model(path)


def test_shape_mismatch_is_named(hf_checkpoint):
    path, file, tensors = _single_file(hf_checkpoint)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.0.mlp.up_proj.weight has "
                                              r"shape \(95, 64\), the config implies \(96, 64\)"):
        load_model(path)


def test_unsupported_tensor_dtype_is_named(hf_checkpoint):
    path, file, tensors = _single_file(hf_checkpoint)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match="tensor model.norm.weight has dtype I8"):
        load_model(path)


@pytest.mark.parametrize("damage", [lambda b: b"\x00" * 8 + b[8:], lambda b: b[:len(b) // 2]])
def test_corrupt_file_is_named(hf_checkpoint, damage):
    path, file, _ = _single_file(hf_checkpoint)
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_model(path)


def test_missing_shard_and_files(hf_checkpoint, tmp_path):
    hf_model, path = hf_checkpoint("Phi3ForCausalLM")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: shard named by .*index.json is missing"):
        load_model(tmp_path / "sharded")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        load_model(path)


def test_random_weights_from_config_alone():
    config = ModelConfig("Qwen3ForCausalLM", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=8,
                         max_position_embeddings=64)
    a, b = random_model(config, seed=3), random_model(config, seed=3)
    assert a.dtype == torch.bfloat16
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if p.dim() == 1:
            assert torch.all(p == 1), name
        else:
            assert 0.01 < p.float().std() < 0.03, name
