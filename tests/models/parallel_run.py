"""Tensor-parallel runs for the tests: ``world_size`` CPU processes joined by gloo, each building its rank of a model
and running the harness's steps over it; what every rank computed comes back to the test process.

The same ``build`` and ``outputs`` give the unsharded reference in the test process, so both sides run the same step
sequence through the same step buffers.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from blink.errors import ConfigError
from blink.models import ModelConfig, TensorParallel, build_model, load_model, random_model
from blink.models.e4m3 import dequantize
from blink.models.projection import Projection
from tests.models.harness import greedy_continuations, mixed_batches

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY_TOKENS = 6
RANDOM_STD = 0.1  # wide enough that greedy picks are not near-ties
# random weights: a dense layer then a MoE layer; 4 query and 2 KV heads
TINY_MOE = ModelConfig("Qwen3MoeForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=16,
                       max_position_embeddings=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=(0,))


def build(source: Path | ModelConfig, tp: TensorParallel = TensorParallel(), group=None):
    """A float32 model (rank ``tp.rank`` of it): loaded from a checkpoint directory, or random from a config."""
    if isinstance(source, ModelConfig):
        return random_model(source, dtype=torch.float32, std=RANDOM_STD, tp=tp, group=group)
    return load_model(source, dtype=torch.float32, tp=tp, group=group)


def outputs(model) -> dict:
    """What the tests compare: every sampled row of ``mixed_batches`` (prefills, a chunked prefill and decodes in
    padded buckets) and ``GREEDY_TOKENS`` greedy tokens after each of ``PROMPTS`` (one prefill, then decodes)."""
    return dict(rows=mixed_batches(model), greedy=greedy_continuations(model, PROMPTS, GREEDY_TOKENS))


def assembled(model, shards: list):
    """``model`` (unsharded, float32) with every projection replaced by ``shards``' FP8 ones (one model per rank, in
    rank order) dequantized and put back together: the function a tensor-parallel run of the shards computes."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            head, _, leaf = name.rpartition(".")
            if leaf != "weight" or not isinstance(model.get_submodule(head), Projection):
                continue
            for shard in shards:
                projection, split = shard.get_submodule(head), shard.weight_split(name)
                local = dequantize(projection.weight, projection.scale, projection.block)
                dim = split.dim + p.dim() - 2  # experts: the split cuts each expert's matrix
                for source, target in shard.tp.pieces(split):
                    p[(slice(None),) * dim + (source,)] = local[(slice(None),) * dim + (target,)]
    return model


def run_ranks(world_size: int, sources: dict[str, Path | ModelConfig], tmp: Path) -> list[dict]:
    """Per rank: ``{"cases": {name: outputs}, "mismatch": error}``, ``error`` the message of building a model whose
    ``TensorParallel`` names another rank than its process group does."""
    torch.multiprocessing.start_processes(_rank, args=(world_size, sources, tmp), nprocs=world_size,
                                          start_method="spawn")
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(world_size)]


def _rank(rank: int, world_size: int, sources: dict, tmp: Path) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        cases = {name: outputs(build(source, TensorParallel(world_size, rank), group))
                 for name, source in sources.items()}
        try:
            build_model(TINY_MOE, "meta", tp=TensorParallel(world_size, (rank + 1) % world_size), group=group)
            mismatch = None
        except ConfigError as e:
            mismatch = str(e)
        torch.save(dict(cases=cases, mismatch=mismatch), tmp / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
