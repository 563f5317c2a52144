"""config.json parsing: both RoPE spellings, derived fields, and errors that name what is wrong."""
import json

import pytest

from blink.models.config import ConfigError, ModelConfig

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}}


def test_llama31_config():
    c = ModelConfig.from_hf(LLAMA)
    assert (c.head_dim, c.rotary_dim, c.q_size, c.kv_size) == (128, 128, 4096, 1024)
    assert c.rope_scaling.factor == 8.0 and c.rope_theta == 500000.0 and not c.tie_word_embeddings


def test_transformers5_rope_parameters_spelling():
    hf = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = dict(LLAMA["rope_scaling"], rope_theta=500000.0)
    assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(LLAMA)


def test_round_trip_through_hf_dict():
    c = ModelConfig.from_hf(LLAMA)
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_phi4_mini_partial_rotary():
    hf = dict(LLAMA, architectures=["Phi3ForCausalLM"], hidden_size=3072, num_attention_heads=24,
              partial_rotary_factor=0.75, rope_scaling=None, sliding_window=262144)
    c = ModelConfig.from_hf(hf)
    assert (c.head_dim, c.rotary_dim, c.sliding_window) == (128, 96, 262144)


QWEN3_MOE = dict(LLAMA, architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_scaling=None,
                 rope_theta=1e6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], sliding_window=4096)


def test_qwen3_moe_config():
    c = ModelConfig.from_hf(QWEN3_MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.sliding_window == 0 and all(c.is_moe_layer(i) for i in range(48))
    assert ModelConfig.from_hf(c.to_hf()) == c
    # transformers 5 writes num_local_experts; HF defaults: norm_topk_prob false, every layer sparse
    hf = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "norm_topk_prob", "decoder_sparse_step",
                                                          "mlp_only_layers")}
    assert ModelConfig.from_hf(dict(hf, num_local_experts=128)) == ModelConfig.from_hf(
        dict(QWEN3_MOE, norm_topk_prob=False))


def test_dense_layers_of_a_moe_config():
    c = ModelConfig.from_hf(dict(QWEN3_MOE, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not ModelConfig.from_hf(LLAMA).is_moe_layer(0)


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 129}, r"num_experts_per_tok \(129\) must be <= num_experts \(128\)"),
    ({"num_experts": 0}, "num_experts must be a positive int"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive int"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [2, 48]}, r"mlp_only_layers \[48\] are not layers of a 48-layer model"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_moe_errors_name_the_field(change, words):
    with pytest.raises(ConfigError, match="x/config.json: " + words):
        ModelConfig.from_hf(dict(QWEN3_MOE, **change), "x/config.json")


def test_moe_fields_are_required_or_refused():
    with pytest.raises(ConfigError, match="missing field 'num_experts'"):
        ModelConfig.from_hf({k: v for k, v in QWEN3_MOE.items() if k != "num_experts"})
    with pytest.raises(ConfigError, match="missing field 'moe_intermediate_size'"):
        ModelConfig.from_hf({k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"})
    with pytest.raises(ConfigError, match="num_experts=8: LlamaForCausalLM has no experts"):
        ModelConfig(**{**ModelConfig.from_hf(LLAMA).__dict__, "num_experts": 8})


@pytest.mark.parametrize("change, words", [
    ({"architectures": ["MixtralForCausalLM"]}, "MixtralForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"torch_dtype": "float8_e4m3fn"}, "float8_e4m3fn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"rope_scaling": dict(LLAMA["rope_scaling"], low_freq_factor=5.0)}, "low_freq_factor"),
])
def test_errors_name_the_field(change, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_hf(dict(LLAMA, **change), "x/config.json")


def test_missing_field_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "vocab_size"}))
    with pytest.raises(ConfigError, match="config.json: missing field 'vocab_size'"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_file(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
