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
