"""The paper's four models at full size: their config.json files build models (on the meta device: shapes only)
with exactly the parameter counts their checkpoints have."""
import pytest

from blink.models import build_model
from blink.models.decoder import SparseMoE
from blink.models.shapes import SHAPES, shape_config, shape_dir

# Parameters of the published bf16 checkpoints (Meta-Llama-3-8B, phi-4, Qwen3-32B, Qwen3-30B-A3B)
PARAMETERS = {"llama-3-8b": 8_030_261_248, "phi-4": 14_659_507_200, "qwen3-32b": 32_762_123_264,
              "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("name", SHAPES)
def test_full_size_models_have_their_checkpoints_parameter_counts(name):
    model = build_model(shape_config(name), "meta")
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    assert (shape_dir(name) / "config.json").is_file()


def test_qwen3_30b_a3b_routes_every_layer_to_8_of_128_experts():
    config = shape_config("qwen3-30b-a3b")
    model = build_model(config, "meta")
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.weight.shape) == (128, 2 * 768, 2048)
    assert (config.num_experts_per_tok, config.norm_topk_prob, config.num_kv_heads) == (8, True, 4)


def test_unknown_shape_names_the_choices():
    with pytest.raises(ValueError, match="no model shape 'qwen3-8b'; shapes: llama-3-8b, phi-4"):
        shape_dir("qwen3-8b")
