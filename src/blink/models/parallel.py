"""Tensor parallelism: one model over ``world_size`` ranks (one process per GPU), Megatron style.

Each layer's first GEMMs are column-parallel (every rank computes some output features from the whole input), its
last ones row-parallel (every rank multiplies its features by its columns, giving a partial sum of the whole
output), and one all-reduce per row-parallel GEMM sums the partials. What a rank holds (``weight_split``):

- ``qkv_proj``: its ``num_heads / N`` query heads and the key/value heads they read. With fewer KV heads than ranks
  (``N`` a multiple of ``num_kv_heads``) each KV head sits on ``N / num_kv_heads`` consecutive ranks, as in vLLM.
- ``o_proj``: the input columns of its query heads (row-parallel, then all-reduce).
- dense ``gate_up_proj``: ``intermediate_size / N`` rows of gate and as many of up; ``down_proj``: those columns.
- experts: every expert, each cut like a dense MLP by ``moe_intermediate_size`` (the router is replicated, so every
  rank routes a token to the same experts and sums its share of each; one all-reduce after the experts).
- replicated: embeddings, LM head, RMSNorm weights (incl. Qwen3's per-head q/k norms), the MoE router.

Invariant the engine relies on: the all-reduce gives every rank the same sum bit for bit (true of gloo and of
NCCL's ring and tree algorithms, which reduce each element once and broadcast it), so the residual stream, the
replicated LM head's logits and the in-step sampled tokens are identical on every rank, and one scheduler per GPU
makes the same decisions from the same ring.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from blink.errors import ConfigError

from .config import ModelConfig


@dataclass(frozen=True)
class Split:
    """How a rank's weight matrix is cut from the full one: along ``dim`` (0: output rows, column-parallel; 1: input
    columns, row-parallel) the full matrix is consecutive ``parts`` of ``(full, local)`` size (q, k, v or gate, up
    of a fused matrix; one part otherwise), and the rank's matrix is the rank's ``local`` slice of each, in order.
    A replicated tensor is one part with ``full == local``."""

    dim: int
    parts: tuple[tuple[int, int], ...]

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each part begins in the full matrix."""
        return tuple(itertools.accumulate((full for full, _ in self.parts[:-1]), initial=0))

    @property
    def full_size(self) -> int:
        return sum(full for full, _ in self.parts)


@dataclass(frozen=True)
class TensorParallel:
    """This process is rank ``rank`` of ``world_size`` tensor-parallel ranks. The process group that connects them
    is passed beside it (``DecoderLM(..., group=...)``): this is only the arithmetic of who holds what."""

    world_size: int = 1
    rank: int = 0

    def __post_init__(self):
        for f in ("world_size", "rank"):
            if type(getattr(self, f)) is not int:
                raise ConfigError(f"TensorParallel.{f} must be an int (got {getattr(self, f)!r})")
        if self.world_size < 1:
            raise ConfigError(f"TensorParallel.world_size must be >= 1 (got {self.world_size})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"TensorParallel.rank must be in 0..{self.world_size - 1} (got {self.rank})")

    def shard(self, config: ModelConfig) -> ModelConfig:
        """The shapes one rank holds: heads, KV heads (at least one) and MLP widths divided by ``world_size``;
        ``config`` itself at world size 1. ``ConfigError`` naming the field when one does not divide."""
        n = self.world_size
        if n == 1:
            return config
        if config.num_heads % n:
            raise ConfigError(f"num_attention_heads ({config.num_heads}) must be a multiple of the tensor parallel "
                              f"size ({n})")
        if config.num_kv_heads % n and n % config.num_kv_heads:
            raise ConfigError(f"num_key_value_heads ({config.num_kv_heads}) must be a multiple or a divisor of the "
                              f"tensor parallel size ({n}): KV heads are split, or replicated when fewer than ranks")
        for f in ("intermediate_size", "moe_intermediate_size"):
            if getattr(config, f) % n:
                raise ConfigError(f"{f} ({getattr(config, f)}) must be a multiple of the tensor parallel size ({n})")
        local = replace(config, num_heads=config.num_heads // n, num_kv_heads=max(config.num_kv_heads // n, 1),
                        intermediate_size=config.intermediate_size // n,
                        moe_intermediate_size=config.moe_intermediate_size // n)
        _check_blocks(config, local, n)
        return local

    def part(self, full: int, local: int) -> slice:
        """This rank's ``local`` of a part of ``full``: ``full / local`` distinct slices, each held by
        ``world_size / (full / local)`` consecutive ranks (one slice on every rank: replicated)."""
        holders = self.world_size // (full // local)
        start = self.rank // holders * local
        return slice(start, start + local)

    def pieces(self, split: Split) -> tuple[tuple[slice, slice], ...]:
        """Per part of ``split``: (the range of the full matrix along ``split.dim`` this rank holds, the range of
        the rank's matrix it goes to)."""
        out, at = [], 0
        for start, (full, local) in zip(split.starts, split.parts):
            mine = self.part(full, local)
            out.append((slice(start + mine.start, start + mine.stop), slice(at, at + local)))
            at += local
        return tuple(out)

    def check_group(self, group) -> None:
        """``ConfigError`` unless ``group`` (None: torch's default group) has ``world_size`` ranks with this
        process as ``rank``. Only where ``torch.distributed`` is initialised: a model built for a memory plan (on
        the meta device) or for loading tests has no group."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (self.world_size, self.rank):
            raise ConfigError(f"{self} does not match its process group (rank {rank} of {size})")


def _check_blocks(config: ModelConfig, local: ModelConfig, n: int) -> None:
    """With FP8 block scales, every width a rank cuts (heads' rows and o_proj's columns, MLP and expert rows and
    down's columns) must be whole blocks: a block's scale cannot be cut. ``ConfigError`` naming the width."""
    quant = config.quantization
    if quant is None or quant.weight_block_size is None:
        return
    for name in ("q_size", "kv_size", "intermediate_size", "moe_intermediate_size"):
        width = getattr(local, name)
        if width and any(width % size for size in quant.weight_block_size):
            raise ConfigError(f"quantization_config.weight_block_size {list(quant.weight_block_size)} with "
                              f"tensor_parallel_size {n}: {name} {getattr(config, name)} gives each rank {width}, "
                              "not whole blocks of rows and columns")


def weight_split(fused: str, experts: bool, config: ModelConfig, local: ModelConfig, rows: int) -> Split:
    """How the parameter ``...<fused>.<leaf>`` of a rank (each expert's matrix when ``experts``) with ``rows`` rows
    is cut from the full model's (``config``; ``local`` is ``TensorParallel.shard(config)``)."""
    q, kv = (config.q_size, local.q_size), (config.kv_size, local.kv_size)
    width = (config.moe_intermediate_size, local.moe_intermediate_size) if experts else \
        (config.intermediate_size, local.intermediate_size)
    splits = {"qkv_proj": Split(0, (q, kv, kv)), "o_proj": Split(1, (q,)), "gate_up_proj": Split(0, (width, width)),
              "down_proj": Split(1, (width,))}
    return splits.get(fused, Split(0, ((rows, rows),)))


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` in place and return it: NCCL for CUDA tensors, gloo for CPU ones (the
    group's backend). The one collective of the model step, so the one place to change how it is issued."""
    dist.all_reduce(x, group=group)
    return x
