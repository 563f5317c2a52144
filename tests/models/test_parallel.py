"""Tensor parallelism on the CPU: every family's model split over two gloo processes computes the unsharded model's
steps (prefill, chunked prefill and decodes through the step buffers, and greedy continuations), every rank the same
logits bit for bit, FP8 checkpoints (per-channel, per-tensor, block scales) included; each rank loads only its
slices; KV pools and memory plans are a rank's; sizes that do not split are refused by field name."""
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from blink.errors import ConfigError
from blink.models import TensorParallel, build_model, load_model, plan_memory, random_model
from blink.models.e4m3 import dequantize, quantize_rows
from blink.models.memory import GIB
from blink.models.quantization import Fp8Config
from blink.models.shapes import shape_config
from tests.models.fp8_checkpoints import write_fp8_checkpoint
from tests.models.harness import tiny_hf_model
from tests.models.parallel_run import TINY_MOE, assembled, build, outputs, run_ranks

WORLD = 2
# tiny_hf_model's shapes: 4 query heads and 2 KV heads of 16 dims, hidden 64, intermediate 96, 2 layers
CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-one-kv-head": ("LlamaForCausalLM", dict(num_key_value_heads=1)),  # the KV head is on both ranks
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              mlp_only_layers=[0])),  # a dense layer, then a MoE layer
    "phi3": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.5, sliding_window=6)),
}
# FP8 checkpoints of some of them: (case, variant); blocks of 16, so that a rank's share of every width is whole blocks
FP8_CASES = {"llama-fp8-channel": ("llama", "ct-channel"), "phi3-fp8-tensor": ("phi3", "fp8-tensor"),
             "qwen3-moe-fp8-block": ("qwen3-moe", "fp8-block")}
TP_BLOCK = [16, 16]
RANDOM = "random-qwen3-moe"
RANDOM_FP8 = "random-qwen3-moe-fp8"  # --quantization fp8: each rank quantizes its shard
# float32: the ranks' partial sums are added in another order than the unsharded GEMMs' (measured: <= 2e-6 on
# logits of magnitude ~3)
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
H200 = 139 * GIB


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-checkpoints")
    for name, (arch, overrides) in CASES.items():
        tiny_hf_model(arch, **overrides).save_pretrained(root / name)
    for name, (case, variant) in FP8_CASES.items():
        arch, overrides = CASES[case]
        write_fp8_checkpoint(tiny_hf_model(arch, **overrides), root / name, variant, TP_BLOCK)
    return {name: root / name for name in [*CASES, *FP8_CASES]}


@pytest.fixture(scope="module")
def sources(checkpoints):
    return {**checkpoints, RANDOM: TINY_MOE, RANDOM_FP8: replace(TINY_MOE, quantization=Fp8Config())}


@pytest.fixture(scope="module")
def ranks(sources, tmp_path_factory):
    """One two-process run over every case (process start-up dominates the cost)."""
    return run_ranks(WORLD, sources, tmp_path_factory.mktemp("tp-run"))


@pytest.mark.parametrize("case", [*CASES, *FP8_CASES, RANDOM])
def test_sharded_steps_equal_the_unsharded_model(case, sources, ranks):
    want = outputs(build(sources[case]))
    for rank in ranks:
        got = rank["cases"][case]
        assert got["greedy"] == want["greedy"]
        assert [row[0] for row in got["rows"]] == [row[0] for row in want["rows"]]  # same sequences sampled
        for (_, logits, token, logprob), (_, want_logits, want_token, want_logprob) in zip(got["rows"], want["rows"]):
            torch.testing.assert_close(logits, want_logits, **TOLERANCE)
            torch.testing.assert_close(logprob, want_logprob, **TOLERANCE)
            assert token == want_token
    # the all-reduce leaves the same sums on every rank: one scheduler per GPU sees the same tokens
    first, second = (rank["cases"][case]["rows"] for rank in ranks)
    for (_, a, token_a, logprob_a), (_, b, token_b, logprob_b) in zip(first, second):
        assert torch.equal(a, b) and token_a == token_b and torch.equal(logprob_a, logprob_b)


def test_a_model_built_for_another_rank_than_its_process_group_is_refused(ranks):
    for rank, run in enumerate(ranks):
        assert run["mismatch"] == (f"TensorParallel(world_size=2, rank={1 - rank}) does not match its process group "
                                   f"(rank {rank} of 2)")


def _rows(t: torch.Tensor, start: int, n: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, n)


@pytest.mark.parametrize("rank", range(WORLD))
def test_phi3_fused_tensors_are_cut_part_by_part(rank, checkpoints):
    stored = load_file(checkpoints["phi3"] / "model.safetensors")
    layer = load_model(checkpoints["phi3"], dtype=torch.float32, tp=TensorParallel(WORLD, rank)).model.layers[1]
    qkv, gate_up = stored["model.layers.1.self_attn.qkv_proj.weight"], stored["model.layers.1.mlp.gate_up_proj.weight"]
    q, kv, inter = 4 * 16, 2 * 16, 96  # full sizes; a rank holds half of each
    want_qkv = torch.cat([_rows(qkv, rank * q // 2, q // 2), _rows(qkv, q + rank * kv // 2, kv // 2),
                          _rows(qkv, q + kv + rank * kv // 2, kv // 2)])
    want_gate_up = torch.cat([_rows(gate_up, rank * inter // 2, inter // 2),
                              _rows(gate_up, inter + rank * inter // 2, inter // 2)])
    assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, want_gate_up)
    assert torch.equal(layer.self_attn.o_proj.weight,
                       _rows(stored["model.layers.1.self_attn.o_proj.weight"], rank * q // 2, q // 2, dim=1))
    assert torch.equal(layer.mlp.down_proj.weight,
                       _rows(stored["model.layers.1.mlp.down_proj.weight"], rank * inter // 2, inter // 2, dim=1))


@pytest.mark.parametrize("rank", range(4))
def test_kv_heads_fewer_than_ranks_go_with_their_query_heads(rank, checkpoints):
    """4 ranks, 4 query heads, 2 KV heads: rank r holds query head r and KV head r // 2, the one that head reads."""
    stored = load_file(checkpoints["llama"] / "model.safetensors")
    model = load_model(checkpoints["llama"], dtype=torch.float32, tp=TensorParallel(4, rank))
    head = lambda name, h: _rows(stored[f"model.layers.0.self_attn.{name}_proj.weight"], h * 16, 16)  # noqa: E731
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.weight, torch.cat([head("q", rank), head("k", rank // 2), head("v", rank // 2)]))
    assert torch.equal(attn.o_proj.weight, _rows(stored["model.layers.0.self_attn.o_proj.weight"], rank * 16, 16, 1))
    assert model.allocate_kv_cache(3, 4).shape == (2, 2, 3, 4, 1, 16)
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])  # replicated


@pytest.mark.parametrize("rank", range(WORLD))
def test_each_rank_holds_a_slice_of_every_expert(rank, checkpoints):
    stored = load_file(checkpoints["qwen3-moe"] / "model.safetensors")
    mlp = load_model(checkpoints["qwen3-moe"], dtype=torch.float32, tp=TensorParallel(WORLD, rank)).model.layers[1].mlp
    expert = lambda e, name: stored[f"model.layers.1.mlp.experts.{e}.{name}.weight"]  # noqa: E731
    assert mlp.experts.gate_up_proj.weight.shape == (8, 2 * 16, 64)
    assert mlp.experts.down_proj.weight.shape == (8, 64, 16)
    for e in range(8):
        want = torch.cat([_rows(expert(e, "gate_proj"), rank * 16, 16), _rows(expert(e, "up_proj"), rank * 16, 16)])
        assert torch.equal(mlp.experts.gate_up_proj.weight[e], want)
        assert torch.equal(mlp.experts.down_proj.weight[e], _rows(expert(e, "down_proj"), rank * 16, 16, dim=1))
    assert torch.equal(mlp.gate.weight, stored["model.layers.1.mlp.gate.weight"])  # the router is replicated


def test_random_shards_are_slices_of_the_unsharded_random_model():
    full = random_model(TINY_MOE, seed=4).model.layers[1]
    for rank in range(WORLD):
        layer = random_model(TINY_MOE, seed=4, tp=TensorParallel(WORLD, rank)).model.layers[1]
        assert torch.equal(layer.self_attn.o_proj.weight, _rows(full.self_attn.o_proj.weight, rank * 32, 32, dim=1))
        assert torch.equal(layer.mlp.experts.down_proj.weight,
                           _rows(full.mlp.experts.down_proj.weight, rank * 16, 16, dim=2))
        assert torch.equal(layer.mlp.gate.weight, full.mlp.gate.weight)


def test_fp8_random_shards_quantize_their_own_slices():
    """``--quantization fp8`` under tensor parallelism: a rank quantizes its shard of the model-dtype weights, so a
    column-parallel projection has the unsharded model's scales for its rows and a row-parallel one the scales of
    its own columns (as vLLM's ranks quantize theirs); dequantized, every shard is its model-dtype slice to within
    e4m3's rounding."""
    fp8 = replace(TINY_MOE, quantization=Fp8Config())
    full, full_fp8 = (random_model(c, seed=4).model.layers[1] for c in (TINY_MOE, fp8))
    for rank in range(WORLD):
        layer = random_model(fp8, seed=4, tp=TensorParallel(WORLD, rank)).model.layers[1]
        q = layer.self_attn.qkv_proj
        assert torch.equal(q.weight_scale[:32], _rows(full_fp8.self_attn.qkv_proj.weight_scale, rank * 32, 32))
        o = layer.self_attn.o_proj
        o_slice = _rows(full.self_attn.o_proj.weight, rank * 32, 32, dim=1)
        codes, scale = quantize_rows(o_slice)
        assert torch.equal(o.weight_scale, scale) and torch.equal(o.weight.view(torch.uint8), codes.view(torch.uint8))
        torch.testing.assert_close(dequantize(o.weight, o.weight_scale, None), o_slice.float(), rtol=2 ** -4, atol=0)


def test_fp8_ranks_that_quantize_their_shards_compute_those_shards_put_together(sources, ranks):
    """Bit for bit alike on both ranks, and the unsharded model of the ranks' dequantized shards: nothing but the
    per-shard scales separates them from the unsharded FP8 model."""
    config = sources[RANDOM_FP8]
    shards = [build(config, TensorParallel(WORLD, rank)) for rank in range(WORLD)]
    want = outputs(assembled(build(replace(config, quantization=None)), shards))
    for rank in ranks:
        got = rank["cases"][RANDOM_FP8]
        assert got["greedy"] == want["greedy"]
        for (_, logits, token, _), (_, want_logits, want_token, _) in zip(got["rows"], want["rows"]):
            torch.testing.assert_close(logits, want_logits, **TOLERANCE)
            assert token == want_token
    first, second = (rank["cases"][RANDOM_FP8]["rows"] for rank in ranks)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, second))


def test_memory_plan_of_a_rank():
    config = shape_config("qwen3-32b")  # 64 query heads, 8 KV heads, untied embeddings
    whole, rank = plan_memory(config, H200), plan_memory(config, H200, tp=TensorParallel(2, 1))
    c = config
    replicated = 2 * (2 * c.vocab_size * c.hidden_size + c.num_layers * (2 * c.hidden_size + 2 * c.head_dim)
                      + c.hidden_size)  # bf16 embeddings, LM head, norms
    assert rank.weight_bytes == (whole.weight_bytes - replicated) // 2 + replicated
    assert 2 * rank.kv_page_bytes == whole.kv_page_bytes and rank.num_pages > 2 * whole.num_pages
    moe = shape_config("qwen3-30b-a3b")  # 4 KV heads over 8 ranks: one each, every head on 2 ranks
    assert 4 * plan_memory(moe, H200, tp=TensorParallel(8, 5)).kv_page_bytes == plan_memory(moe, H200).kv_page_bytes


def test_world_size_one_is_the_unsharded_model():
    assert TensorParallel().shard(TINY_MOE) is TINY_MOE
    assert build_model(TINY_MOE, "meta").local_config is TINY_MOE


@pytest.mark.parametrize("fields, message", [
    (dict(world_size=0), r"TensorParallel.world_size must be >= 1 \(got 0\)"),
    (dict(world_size=2, rank=2), r"TensorParallel.rank must be in 0..1 \(got 2\)"),
    (dict(world_size=2, rank=-1), r"TensorParallel.rank must be in 0..1 \(got -1\)"),
    (dict(world_size=2.0), r"TensorParallel.world_size must be an int \(got 2.0\)"),
])
def test_bad_tensor_parallel_fields_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        TensorParallel(**fields)


@pytest.mark.parametrize("config, world_size, message", [
    (shape_config("qwen3-32b"), 3, r"num_attention_heads \(64\) must be a multiple of the tensor parallel size \(3\)"),
    (shape_config("phi-4"), 4, r"num_key_value_heads \(10\) must be a multiple or a divisor of the tensor parallel "
                               r"size \(4\)"),
    (replace(TINY_MOE, intermediate_size=90), 4, r"intermediate_size \(90\) must be a multiple of the tensor "
                                                 r"parallel size \(4\)"),
    (replace(TINY_MOE, moe_intermediate_size=30), 4, r"moe_intermediate_size \(30\) must be a multiple"),
])
def test_sizes_that_do_not_split_are_refused_by_field(config, world_size, message):
    with pytest.raises(ConfigError, match=message):
        build_model(config, "meta", tp=TensorParallel(world_size, 0))
