"""FP8 checkpoints and ``--quantization fp8`` on the CPU reference path (dequantize, then matmul): every variant of
every family computes what transformers computes with the dequantized weights; unsupported configs are refused by
field name."""
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from blink.models import CheckpointError, ConfigError, ModelConfig, TensorParallel, load_model, random_model
from blink.models.e4m3 import FP8, dequantize
from blink.models.quantization import Fp8Config
from tests.models.fp8_checkpoints import VARIANTS, write_fp8_checkpoint
from tests.models.harness import check_cpu_engine_greedy, check_mixed_batches, decode, tiny_hf_model

FAMILIES = {  # architecture → what its tiny checkpoint sets beyond the harness's defaults
    "LlamaForCausalLM": {}, "Qwen3ForCausalLM": {}, "Phi3ForCausalLM": {"sliding_window": 7},
    "Qwen3MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "norm_topk_prob": True, "mlp_only_layers": [1]},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_fp8_checkpoint_matches_the_dequantized_model(tmp_path, arch, variant):
    reference = write_fp8_checkpoint(tiny_hf_model(arch, **FAMILIES[arch]), tmp_path / "fp8", variant)
    model = load_model(tmp_path / "fp8", dtype=torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.scale.dtype == torch.float32
    check_mixed_batches(model, reference)


def per_channel_quantized(hf_model) -> dict[str, torch.Tensor]:
    """The dequantized projections of ``--quantization fp8``: each output row scaled to e4m3's largest value (vLLM's
    per-channel scheme), by HF's in-memory parameter names."""
    quantized = {}
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "_proj" in name:
                scale = p.abs().amax(-1, keepdim=True) / 448.0
                quantized[name] = (p / scale).to(torch.float8_e4m3fn).float() * scale
    return quantized


def test_quantization_fp8_quantizes_bf16_weights_per_channel_at_load(hf_checkpoint):
    hf_model, path = hf_checkpoint("Qwen3MoeForCausalLM", **FAMILIES["Qwen3MoeForCausalLM"])
    model = load_model(path, dtype=torch.float32, quantization="fp8")
    assert model.config.quantization == Fp8Config()
    quantized = per_channel_quantized(hf_model)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.weight.dtype == torch.float8_e4m3fn and experts.scale.shape == (4, 64)
    torch.testing.assert_close(dequantize(experts.weight, experts.scale, None),
                               quantized["model.layers.0.mlp.experts.gate_up_proj"], rtol=0, atol=0)
    hf_model.load_state_dict({**hf_model.state_dict(), **quantized})
    check_mixed_batches(model, hf_model)


def test_the_engine_serves_an_fp8_kv_cache(hf_checkpoint):
    """``kv_cache_dtype="fp8"``: the CPU engine's greedy tokens and their log-probabilities are the reference path's
    over an e4m3 pool, which sit measurably apart from a float32 pool's."""
    from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig

    _, path = hf_checkpoint("LlamaForCausalLM")
    prompts = [[5, 6, 7, 8], [9, 10]]
    model = load_model(path, dtype=torch.float32)
    want_logprobs, want = decode(model, prompts, 6, kv_dtype=FP8)
    exact_logprobs, _ = decode(model, prompts, 6, want)
    assert (want_logprobs - exact_logprobs).abs().max() > 1e-3
    engine = Engine(EngineConfig(model=str(path), device="cpu", kv_cache_dtype="fp8", max_prompt_tokens=32,
                                 max_output_tokens=16, n_slots=8,
                                 scheduler=SchedulerConfig(num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
                                                           max_model_len=48)))
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                          logprobs=True))
    finally:
        engine.close()
    assert [out.token_ids for out in outputs] == want.tolist()
    assert torch.allclose(torch.tensor([out.logprobs for out in outputs]), want_logprobs, atol=1e-4)


def test_the_engine_serves_quantization_fp8(hf_checkpoint):
    hf_model, path = hf_checkpoint("LlamaForCausalLM")
    hf_model.load_state_dict({**hf_model.state_dict(), **per_channel_quantized(hf_model)})
    check_cpu_engine_greedy(hf_model, path, quantization="fp8")


def test_random_fp8_models_have_the_checkpoint_layouts(hf_checkpoint):
    config = ModelConfig.from_file(hf_checkpoint("Qwen3MoeForCausalLM", **FAMILIES["Qwen3MoeForCausalLM"])[1])
    block = random_model(replace(config, quantization=Fp8Config((32, 32))), dtype=torch.float32)
    ref = random_model(config, dtype=torch.float32)
    down = block.model.layers[0].mlp.experts.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale_inv.shape == (4, 2, 1)
    want = ref.model.layers[0].mlp.experts.down_proj.weight
    err = (dequantize(down.weight, down.scale, (32, 32)) - want).abs() / want.abs().amax()
    assert 0 < err.max() <= 2 ** -4  # e4m3 rounding: half a unit of its 3-bit mantissa, relative to the block max


def _refused(tmp_path, quantization_config, match, error=ConfigError, **load):
    hf_model = tiny_hf_model("LlamaForCausalLM")
    write_fp8_checkpoint(hf_model, tmp_path / "fp8", "fp8-block")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=match):
        load_model(tmp_path / "fp8", dtype=torch.float32, **load)


CT = VARIANTS["ct-channel"]
CT_WEIGHTS = CT["config_groups"]["group_0"]["weights"]


def _ct(**weights):
    return {**CT, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**CT_WEIGHTS, **weights}}}}


@pytest.mark.parametrize("quantization_config, match", [
    ({"quant_method": "awq", "bits": 4}, r"quantization_config.quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"quantization_config.fmt 'e5m2' is not supported"),
    ({**VARIANTS["fp8-block"], "weight_block_size": [32, 24]}, r"quantization_config.weight_block_size \[32, 24\]"),
    ({**VARIANTS["fp8-block"], "weight_block_size": [64, 32]},
     r"weight_block_size \[64, 32\]: model.layers.0.self_attn.qkv_proj is fused from parts of \[64, 32, 32\] rows"),
    ({**CT, "format": "pack-quantized"}, r"quantization_config.format 'pack-quantized' is not supported"),
    (_ct(type="int", num_bits=4), r"config_groups.group_0.weights: 4-bit int weights are not supported"),
    (_ct(strategy="group", group_size=128), r"config_groups.group_0.weights.strategy 'group' is not supported"),
    (_ct(symmetric=False), r"config_groups.group_0.weights: only symmetric, static weight scales"),
    ({**CT, "ignore": ["model.layers.1.mlp.down_proj"]},
     r"quantization_config ignores 'model.layers.1.mlp.down_proj', which leaves model.layers.1.mlp.down_proj "
     r"unquantized"),
    ({**VARIANTS["fp8-block"], "ignored_layers": ["re:.*self_attn.*"]},
     r"ignores 're:.\*self_attn.\*', which leaves model.layers.0.self_attn.q_proj unquantized"),
])
def test_unsupported_quantization_configs_are_refused_by_field(tmp_path, quantization_config, match):
    _refused(tmp_path, quantization_config, match)


def test_tensor_parallel_shares_that_cut_a_block_and_unknown_quantizations_are_refused(tmp_path, hf_checkpoint):
    _refused(tmp_path, VARIANTS["fp8-block"], r"weight_block_size \[32, 32\] with tensor_parallel_size 2: "
             "kv_size 32 gives each rank 16, not whole blocks", tp=TensorParallel(2, 0))
    _, path = hf_checkpoint("LlamaForCausalLM")
    with pytest.raises(ConfigError, match="quantization 'int8' is not supported"):
        load_model(path, quantization="int8")


def test_broken_fp8_tensors_are_named(tmp_path):
    reference = write_fp8_checkpoint(tiny_hf_model("LlamaForCausalLM"), tmp_path / "fp8", "ct-channel")
    file = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.0.mlp.up_proj"
    for damage, match in [
        ({f"{name}.weight": reference.state_dict()[f"{name}.weight"].bfloat16()},
         f"tensor {name}.weight has dtype BF16; the checkpoint's quantization_config makes it an FP8 weight"),
        ({f"{name}.weight_scale": tensors[f"{name}.weight_scale"][:5]},
         rf"tensor {name}.weight_scale has shape \(5, 1\); a per-tensor scale has shape \(\) or \(1,\), a "
         rf"per-channel one \(96,\) or \(96, 1\)"),
        ({f"{name}.weight_scale": None}, rf"lacks tensor\(s\) {name}.weight_scale"),
    ]:
        broken = {k: v for k, v in {**tensors, **damage}.items() if v is not None}
        save_file(broken, file)
        with pytest.raises(CheckpointError, match=match):
            load_model(tmp_path / "fp8", dtype=torch.float32)
