"""Memory plans: weights measured on the model, KV pages of the pool's layout, and the pages that fit beside them."""
import pytest
import torch
from tests.models.test_shapes import PARAMETERS

from blink.models.memory import GIB, plan_memory
from blink.models.shapes import SHAPES, shape_config

H200 = 139 * GIB


@pytest.mark.parametrize("name", SHAPES)
def test_plan_fills_the_budget_with_whole_pages(name):
    config = shape_config(name)
    plan = plan_memory(config, H200, page_size=16, utilization=0.9)
    assert plan.weight_bytes == 2 * PARAMETERS[name]  # bf16
    # the pool is [layers, 2, pages, page_size, kv_heads, head_dim]
    assert plan.kv_page_bytes == config.num_layers * 2 * 16 * config.num_kv_heads * config.head_dim * 2
    used = plan.weight_bytes + plan.activation_bytes + plan.kv_bytes
    assert used <= 0.9 * H200 < used + plan.kv_page_bytes
    assert plan.kv_tokens == 16 * plan.num_pages and plan.kv_bytes > 60 * GIB  # every model leaves room for KV


def test_dtype_page_size_and_batch_shape_the_plan():
    config = shape_config("llama-3-8b")
    bf16 = plan_memory(config, H200)
    f32 = plan_memory(config, H200, dtype=torch.float32)
    assert f32.weight_bytes == 2 * bf16.weight_bytes and f32.kv_page_bytes == 2 * bf16.kv_page_bytes
    assert plan_memory(config, H200, page_size=32).kv_page_bytes == 2 * bf16.kv_page_bytes
    assert plan_memory(config, H200, max_num_batched_tokens=8192).activation_bytes > bf16.activation_bytes
    assert plan_memory(config, H200, max_num_seqs=512).activation_bytes > bf16.activation_bytes


def test_a_model_that_does_not_fit_names_the_sizes():
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM in torch.bfloat16: weights 61.0 GiB \+ activations "
                                         r"0.9 GiB leave no KV page in 0.9 of 64.0 GiB"):
        plan_memory(shape_config("qwen3-32b"), 64 * GIB)
