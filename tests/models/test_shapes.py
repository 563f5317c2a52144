"""The paper's four models at full size: their config.json files build models (on the meta device: shapes only)
with exactly the parameter counts their checkpoints have."""
import pytest
import torch

from tests.models.harness import Runner

from blink.device.step import StepLayout
from blink.models import build_model
from blink.models.decoder import SparseMoE
from blink.models.shapes import SHAPES, shape_config, shape_dir

# The logits of a random-weight full-size model reach |4..8|, where one bf16 step is 1/32: two paths that round
# differently (graph buckets, batch shapes, Triton against torch) measured 1 to 7 steps apart on the H200 (0.03 to
# 0.22 in logprob). A wrong kernel moves logits by whole units, not steps.
BF16_LOGPROB = 0.3

# Parameters of the published bf16 checkpoints (Meta-Llama-3-8B, phi-4, Qwen3-32B, Qwen3-30B-A3B, Llama-3.2-1B;
# Qwen3-0.6B's card: 0.6B, 0.44B without the embedding, which its output layer shares)
PARAMETERS = {"llama-3-8b": 8_030_261_248, "phi-4": 14_659_507_200, "qwen3-32b": 32_762_123_264,
              "qwen3-30b-a3b": 30_532_122_624, "llama-3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920}


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
    from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig

    config = EngineConfig(model=model_dir, load_format="dummy", device=device, n_slots=64, max_prompt_tokens=256,
                          max_output_tokens=16, scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                                                          max_model_len=272))
    with Engine(config) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=True))
        stats = engine.stats()
        model = engine.core.backend.model
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
    engine_against_eager_step(str(shape_dir(name)), "cuda", prompts, tolerance=BF16_LOGPROB)



def engine_greedy_against_reference(model_dir, device: str, tie: float, n: int = 16) -> None:
    """Serve six random prompts greedily from ``model_dir`` (random weights) through the Engine, with a token budget
    that splits the longer prompts into chunks sharing steps with the others' decodes; then check every generated
    token against the torch reference kernels run on the same weights, eagerly, teacher-forced with the Engine's
    tokens. Where rounding makes a near-tie (the reference's best two logprobs within ``tie``) either token is
    greedy; that must stay a minority, and the Engine's logprob of each token must be the reference's."""
    from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig
    from blink.models import ModelConfig
    from blink.models.kernels import reference

    g = torch.Generator().manual_seed(1)
    vocab = ModelConfig.from_file(model_dir).vocab_size
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (5, 17, 40, 77, 130, 200)]
    config = EngineConfig(model=str(model_dir), load_format="dummy", device=device, n_slots=16, max_prompt_tokens=256,
                          max_output_tokens=n, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128,
                                                                         max_model_len=256 + n))
    with Engine(config) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, logprobs=True))
        stats = engine.stats()
        model = engine.core.backend.model
    assert stats["launch_error"] == 0 and [len(out.token_ids) for out in outputs] == [n] * len(prompts)

    model.ops = reference
    runner = Runner(model, num_pages=256, layout=StepLayout(512, 8, 64))
    chunks = [runner.chunk(i, p, 0) for i, p in enumerate(prompts)]
    exact, worst = 0, 0.0
    for step in range(n):
        logits, _, _ = runner.step(chunks)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        for row, out in enumerate(outputs):
            token, best = out.token_ids[step], logprobs[row].max()
            assert logprobs[row, token] >= best - tie, (row, step)
            assert abs(out.logprobs[step] - logprobs[row, token]) < tie, (row, step)
            exact += int(token == logprobs[row].argmax())
            worst = max(worst, abs(out.logprobs[step] - logprobs[row, token].item()))
        chunks = [runner.chunk(i, [out.token_ids[step]], len(p) + step) for i, (p, out) in
                  enumerate(zip(prompts, outputs))]
    print(f"{model_dir.name}: {exact} of {n * len(prompts)} tokens are the reference's argmax; logprobs differ by "
          f"{worst:.4f} at most")
    # H200, bf16: 89 of 96 (Qwen3-8B) and 75 of 96 (Llama-3-8B, no q/k norm: sharper attention) are the argmax.
    assert exact >= 0.7 * n * len(prompts), f"only {exact} of {n * len(prompts)} tokens are the reference's argmax"


def test_engine_greedy_equals_the_reference_path_on_the_cpu(tmp_path):
    """The same check on the CPU (float32, a tiny shape): chunked, batched serving changes no token."""
    from blink.bench.shapes import write_model_dir

    engine_greedy_against_reference(write_model_dir(tmp_path / "tiny-qwen3", "tiny-qwen3"), "cpu", tie=1e-4)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3-8b"])
def test_engine_greedy_equals_the_torch_reference_path_at_8b_shapes(name, tmp_path):
    """Random bf16 weights at 8B shapes on the H200: the Engine (Triton kernels in device-launched step graphs)
    against the torch reference kernels (bf16 rounds the two paths differently, hence the tie tolerance)."""
    from blink.bench.shapes import write_model_dir

    engine_greedy_against_reference(write_model_dir(tmp_path / name, name), "cuda", tie=BF16_LOGPROB)
