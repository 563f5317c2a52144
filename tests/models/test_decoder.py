"""Every family's step against HF transformers on tiny random checkpoints: prefill, chunked prefill and decode mixed
in one padded step, with shuffled page placement; one-row steps whose projections compute their pending input rows
(``NormedRow``, ``GatedRow``) against the same steps with each norm and SiLU on its own."""
import pytest
import torch

from blink.models import load_model
from tests.models.harness import Runner, check_mixed_batches, check_step_graph_device_launch, hf_logits

FAMILIES = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_mixed_batches_match_transformers(arch, hf_checkpoint):
    hf_model, path = hf_checkpoint(arch)
    check_mixed_batches(load_model(path, dtype=torch.float32), hf_model)


@pytest.mark.parametrize("arch", FAMILIES)
def test_tied_embeddings(arch, hf_checkpoint):
    hf_model, path = hf_checkpoint(arch, tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32)
    assert model.lm_head_weight() is model.model.embed_tokens.weight
    check_mixed_batches(model, hf_model, seed=1)


def test_rows_that_sample_nothing_keep_their_outputs(hf_checkpoint):
    _, path = hf_checkpoint("LlamaForCausalLM")
    runner = Runner(load_model(path, dtype=torch.float32))
    runner.buf.sampled_ids.fill_(-7)
    _, ids, _ = runner.step([runner.chunk(0, [1, 2, 3], 0, sample=False), runner.chunk(1, [4, 5], 0)])
    assert ids[0] == -7 and ids[1] != -7


def test_bf16_step_tracks_float32(hf_checkpoint):
    hf_model, path = hf_checkpoint("Qwen3ForCausalLM")
    runner = Runner(load_model(path, dtype=torch.bfloat16))
    logits, _, _ = runner.step([runner.chunk(0, list(range(1, 12)), 0)])
    want = hf_logits(hf_model, list(range(1, 12)))[-1]
    assert (logits[0] - want).norm() / want.norm() < 2e-2


@pytest.mark.gpu
def test_step_graph_captures_and_device_launch_instantiation_replays_bit_identically():
    from blink.models import ModelConfig, random_model

    config = ModelConfig("Qwen3ForCausalLM", vocab_size=5000, hidden_size=256, intermediate_size=512, num_layers=3,
                         num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                         rotary_dim=64, max_position_embeddings=4096)
    check_step_graph_device_launch(random_model(config, "cuda"))


def pending_ops(counts):
    """The reference ops, but ``linear`` takes one row's pending inputs (as the GPU's one-row GEMV does) and computes
    them with the reference ops; ``counts`` tallies each kind of input and the norms and SiLUs run on their own."""
    from types import SimpleNamespace

    from blink.models.kernels import OPS, reference
    from blink.models.pending import GatedRow, NormedRow

    def linear(x, weight):
        counts[type(x).__name__] += 1
        if isinstance(x, NormedRow):
            normed, total = reference.rms_norm(x.h, x.weight, x.eps, x.residual)
            x.total.copy_(total)
            x = normed
        elif isinstance(x, GatedRow):
            x = reference.silu_and_mul(x.gate_up)
        return reference.linear(x, weight)

    def counted(name):
        def op(*args, **kwargs):
            counts[name] += 1
            return getattr(reference, name)(*args, **kwargs)
        return op

    ops = {name: getattr(reference, name) for name in OPS}
    return SimpleNamespace(**{**ops, "linear": linear, "linear_takes_pending": lambda rows, weight: rows == 1,
                              "rms_norm": counted("rms_norm"), "silu_and_mul": counted("silu_and_mul")})


def test_one_row_steps_leave_norms_and_silu_to_projections_that_take_pending_rows_with_equal_outputs():
    from collections import Counter

    from blink.models import ModelConfig, random_model

    config = ModelConfig("Qwen3ForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=16,
                         max_position_embeddings=512)
    model = random_model(config, dtype=torch.float32, std=0.2)
    plain_ops, counts = model.ops, Counter()
    runs = []
    for ops in (plain_ops, pending_ops(counts)):
        model.ops, runner = ops, Runner(model)
        runs.append([runner.step([runner.chunk(0, list(range(5, 17)), 0)])])
        counts.clear()                                      # the prefill's 12 rows take none
        runs[-1] += [runner.step([runner.chunk(0, [t], 12 + i)]) for i, t in enumerate((40, 41, 42))]
    for plain, pending in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(plain, pending))
    layers, steps = config.num_layers, 3
    # a step: the first layer's input norm (it gathers the embedding rows) and the final norm on their own
    assert counts == {"rms_norm": 2 * steps, "NormedRow": (2 * layers - 1) * steps, "GatedRow": layers * steps,
                      "Tensor": layers * steps + steps}         # o_proj, and the LM head


@pytest.mark.gpu
def test_one_row_step_with_norms_and_silu_in_the_gemv_replays_by_device_launch_and_matches_them_apart():
    from types import SimpleNamespace

    from blink.models import ModelConfig, random_model
    from blink.models.kernels import OPS, triton_ops
    from tests.models.kernels.conftest import rel_err

    config = ModelConfig("Qwen3ForCausalLM", vocab_size=5000, hidden_size=512, intermediate_size=1024, num_layers=3,
                         num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                         rotary_dim=64, max_position_embeddings=4096)
    model = random_model(config, "cuda", dtype=torch.bfloat16)
    assert all(p.takes_pending(1, model.ops) for layer in model.model.layers
               for p in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    check_step_graph_device_launch(model, bucket=1)
    logits = []
    for takes in (True, False):
        model.ops = SimpleNamespace(**{name: getattr(triton_ops, name) for name in OPS},
                                    linear_takes_pending=lambda rows, weight, takes=takes: takes and rows == 1)
        runner = Runner(model)
        runner.step([runner.chunk(0, list(range(7, 40)), 0)])
        logits.append(runner.step([runner.chunk(0, [44], 33)])[0])
    assert rel_err(logits[0], logits[1].double()) < 1e-2
