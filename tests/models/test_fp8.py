"""FP8 checkpoints and ``--quantization fp8`` on the CPU reference path (dequantize, then matmul): every variant of
every family computes what transformers computes with the dequantized weights; unsupported configs are refused by
field name."""
import pytest
import torch

from blink.models import load_model
from tests.models.fp8_checkpoints import VARIANTS, write_fp8_checkpoint
from tests.models.harness import check_mixed_batches, tiny_hf_model

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
