"""The Triton ops as a whole: the same names as the references, and a full model step built on them that matches
transformers (interpreted on the CPU, compiled on the GPU)."""
import inspect

import pytest
import torch

from blink.models import load_model
from blink.models.kernels import OPS, reference
from tests.models.harness import check_mixed_batches


def test_same_functions_and_signatures_as_the_references():
    from blink.models.kernels import triton_ops

    for name in OPS:
        ours, ref = inspect.signature(getattr(triton_ops, name)), inspect.signature(getattr(reference, name))
        assert list(ours.parameters)[:len(ref.parameters)] == list(ref.parameters), name


ARCHITECTURES = {  # architecture → what its tiny checkpoint sets beyond the harness's defaults
    "LlamaForCausalLM": {}, "Qwen3ForCausalLM": {}, "Phi3ForCausalLM": {"sliding_window": 7},
    "Qwen3MoeForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                            "norm_topk_prob": True, "mlp_only_layers": [1]},
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_model_step_on_triton_ops_matches_transformers(backend, hf_checkpoint, arch):
    device, dtype, _ = backend
    from blink.models.kernels import triton_ops

    hf_model, path = hf_checkpoint(arch, **ARCHITECTURES[arch])
    model = load_model(path, device=device, dtype=dtype)
    model.ops = triton_ops
    check_mixed_batches(model, hf_model, atol=1e-4 if dtype == torch.float32 else 0.15)
