"""Memory plan of one GPU: the weights, the activations of the largest step, and a KV pool in what is left.

Computed from the config alone, before anything is allocated: the weights and the KV page are measured on a model
built on the ``meta`` device (so they are the model's own sizes, not a formula beside it); the activations are an
estimate (the widest per-token tensors of one layer at the largest bucket, plus the float32 logits and the sampling
temporaries of every sequence row). The engine measures its activations instead, by running the largest step once;
this plan says beforehand whether a model fits and about how many tokens of KV the rest holds.

Under tensor parallelism the plan is one rank's: its share of the weights (replicated embeddings, LM head and norms
whole), its KV heads, its activations (the hidden width and the logits rows are whole on every rank).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .e4m3 import FP8
from .loader import build_model
from .parallel import TensorParallel

GIB = 2**30


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for ``EngineConfig.kv_cache_dtype`` (validated there): ``auto``, the model's; ``fp8``,
    e4m3."""
    return FP8 if name == "fp8" else model_dtype


@dataclass(frozen=True)
class MemoryPlan:
    """``num_pages`` KV pages of ``page_size`` tokens fit in ``utilization * gpu_bytes`` beside the weights and the
    activations: ``weight_bytes + activation_bytes + num_pages * kv_page_bytes <= utilization * gpu_bytes``."""

    gpu_bytes: int
    utilization: float
    weight_bytes: int
    activation_bytes: int
    page_size: int
    kv_page_bytes: int
    num_pages: int

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.kv_page_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    def summary(self) -> str:
        return (f"weights {self.weight_bytes / GIB:.1f} GiB, activations {self.activation_bytes / GIB:.1f} GiB, "
                f"KV {self.kv_bytes / GIB:.1f} GiB = {self.num_pages} pages of {self.page_size} "
                f"({self.kv_tokens} tokens) in {self.utilization:g} of {self.gpu_bytes / GIB:.1f} GiB")


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, itemsize: int) -> int:
    """Estimate for the shapes ``config`` (a rank's: ``DecoderLM.local_config``): per token, the residual stream and
    its normed copies (4 x hidden), the attention output and the widest GEMM output of a layer (fused qkv, dense
    gate/up, or a MoE layer's ``top_k`` rows of gate/up products and down outputs), in the model dtype; per sequence
    row, four float32 rows of the vocabulary (logits, scaled logits, sampling temporaries)."""
    c = config
    widest = max(c.q_size + 2 * c.kv_size, 2 * c.intermediate_size,
                 c.num_experts_per_tok * (c.moe_intermediate_size + c.hidden_size))
    per_token = itemsize * (4 * c.hidden_size + c.q_size + widest)
    return max_num_batched_tokens * per_token + max_num_seqs * 4 * c.vocab_size * 4


def kv_page_bytes(model, page_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one KV page across all layers (K and V): one page of the pool ``model.allocate_kv_cache`` makes, in
    ``dtype`` (default the model's)."""
    return math.prod(model.kv_cache_shape(1, page_size)) * (dtype or model.dtype).itemsize


def plan_memory(config: ModelConfig, gpu_bytes: int, page_size: int = 16, utilization: float = 0.9,
                max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                dtype: torch.dtype | str | None = None, tp: TensorParallel = TensorParallel()) -> MemoryPlan:
    """The plan for ``config`` (in ``dtype``, default the config's) on a GPU of ``gpu_bytes`` holding rank
    ``tp.rank``'s share; ``ValueError`` naming the sizes when the weights and activations alone exceed
    ``utilization`` of it."""
    model = build_model(config, "meta", dtype, tp)
    weights = weight_bytes(model)
    page = kv_page_bytes(model, page_size)
    activations = activation_bytes(model.local_config, max_num_batched_tokens, max_num_seqs, model.dtype.itemsize)
    left = utilization * gpu_bytes - weights - activations
    if left < page:
        raise ValueError(f"{config.architecture} in {model.dtype}: weights {weights / GIB:.1f} GiB + activations "
                         f"{activations / GIB:.1f} GiB leave no KV page in {utilization:g} of "
                         f"{gpu_bytes / GIB:.1f} GiB")
    return MemoryPlan(gpu_bytes, utilization, weights, activations, page_size, page, int(left // page))
