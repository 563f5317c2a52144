"""The paper's four models at full size: their config.json files build models (on the meta device: shapes only)
with exactly the parameter counts their checkpoints have."""
import pytest
import torch

from blink.device.step import StepLayout
from blink.models import build_model
from blink.models.decoder import SparseMoE
from blink.models.shapes import SHAPES, shape_config, shape_dir
from harness import Runner

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


def engine_against_eager_step(model_dir: str, device: str, prompts: list[list[int]], tolerance: float):
    """Serve ``prompts`` greedily (8 tokens) from ``model_dir`` with random weights through the Engine, then run the
    Engine's own model eagerly on the prompts: each first token must be that step's argmax up to ``tolerance`` (in
    logprob), and the Engine's logprob of it that step's."""
    from blink import Engine, EngineConfig, SamplingParams

    config = EngineConfig(model=model_dir, load_format="dummy", device=device, max_num_seqs=16,
                          max_num_batched_tokens=256, n_slots=64, max_prompt_tokens=256, max_output_tokens=16)
    with Engine(config) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=True))
        stats = engine.stats()
        model = engine.backend.model
    assert stats["launch_error"] == 0 and [len(out.token_ids) for out in outputs] == [8] * len(prompts)
    runner = Runner(model, num_pages=128, layout=StepLayout(256, 8, 64))
    logits, _, _ = runner.step([runner.chunk(i, p, 0) for i, p in enumerate(prompts)])
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    for row, out in enumerate(outputs):
        first = out.token_ids[0]
        assert logprobs[row, first] >= logprobs[row].max() - tolerance, row
        assert abs(out.logprobs[0] - logprobs[row, first]) < tolerance, row


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", SHAPES)
def test_full_size_model_serves_through_the_engine(name):
    """Random bf16 weights at full size on the H200: the Engine's device-launched step graphs agree with the eager
    step of the same model (bf16: graph buckets and batch shapes round differently, hence the tolerance)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape_config(name).vocab_size, (n,), generator=g).tolist() for n in (5, 40, 130)]
    engine_against_eager_step(str(shape_dir(name)), "cuda", prompts, tolerance=0.05)
