"""The decoder-only transformer every supported family is an instance of, run as one step over a flat packed batch.

Families differ only in how their checkpoints name and split weights (``STACKED``) and in Qwen3's per-head q/k
RMSNorm (``QK_NORM``); ``llama.py``, ``qwen3.py``, ``qwen3_moe.py`` and ``phi3.py`` set those two class attributes.
Inside blink q/k/v and gate/up are always fused (``qkv_proj``, ``gate_up_proj``): one GEMM each. A layer's MLP is
dense or, where ``ModelConfig.is_moe_layer`` says so, a ``SparseMoE`` whose experts are stacked into 3-D parameters
(one GEMM operand per expert) for the fused MoE kernel.

Under tensor parallelism (``parallel.py``) the layers are built from the rank's shapes (``DecoderLM.local_config``)
and the attention and MLP outputs are partial sums, all-reduced over the ranks before the residual add; at world
size 1 the local config is the config and nothing is reduced.

``DecoderLM.forward`` is the model step: it reads only the step buffers of ``blink.device.step`` (first ``T`` token
rows, first ``sample_rows(T)`` sequence rows), writes new K/V into the paged pool, computes logits for the sampled
rows only and samples in-step. On CUDA it uses the Triton kernels and has fixed shapes and no host reads, so it
captures into a CUDA graph per bucket ``T``; on CPU it uses the torch references.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .history import TokenHistory
from .kernels import ops_for
from .parallel import Split, TensorParallel, all_reduce, weight_split
from .projection import Projection, parameter
from .quantization import Fp8Config
from .rope import cos_sin_cache
from .sampler import Sampled, sample

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, qk_norm: bool, **kw):
        super().__init__()
        self.qkv_proj = Projection(c.q_size + 2 * c.kv_size, c.hidden_size, c.quantization, **kw)
        self.o_proj = Projection(c.hidden_size, c.q_size, c.quantization, **kw)
        if qk_norm:
            self.q_norm, self.k_norm = nn.Module(), nn.Module()
            self.q_norm.weight = parameter(c.head_dim, **kw)
            self.k_norm.weight = parameter(c.head_dim, **kw)
        self.c, self.qk_norm = c, qk_norm

    def forward(self, x, positions, cos_sin, kv_layer, slot_mapping, plan, ops):
        c = self.c
        q, k, v = self.qkv_proj(x, ops).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, c.head_dim)) for t in (q, k, v))
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        q = ops.rope_kv_write(q, k, v, positions, cos_sin, kv_layer, slot_mapping, *norms, c.rms_norm_eps)
        o = ops.attention(q, kv_layer, plan, c.head_dim ** -0.5, c.sliding_window)
        return self.o_proj(o.flatten(1), ops)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.gate_up_proj = Projection(2 * c.intermediate_size, c.hidden_size, c.quantization, **kw)
        self.down_proj = Projection(c.hidden_size, c.intermediate_size, c.quantization, **kw)

    def forward(self, x, ops):
        """SiLU-and-multiply, handing the down projection its rows quantized as that one asks (``e4m3_group``)."""
        gate_up = self.gate_up_proj(x, ops)
        group = self.down_proj.e4m3_group(gate_up.shape[0], ops)
        return self.down_proj(ops.silu_and_mul(gate_up, e4m3_group=group), ops)

    def e4m3_group(self, rows: int, ops) -> int:
        return self.gate_up_proj.e4m3_group(rows, ops)


class SparseMoE(nn.Module):
    """Routed experts: ``gate`` scores each token's ``num_experts``; ``ops.fused_moe`` runs the top-k experts.

    ``experts.gate_up_proj.weight [E, 2I, H]`` holds each expert's gate rows then up rows, ``experts.down_proj.weight
    [E, H, I]`` its down projection (HF's in-memory layout; checkpoints store ``experts.<e>.gate_proj.weight`` etc.).
    FP8 experts carry their scales beside them (``Projection``); the router stays in the model dtype.
    """

    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.gate, self.experts = nn.Module(), nn.Module()
        self.gate.weight = parameter(c.num_experts, c.hidden_size, **kw)
        e, q = c.num_experts, c.quantization
        self.experts.gate_up_proj = Projection(2 * c.moe_intermediate_size, c.hidden_size, q, experts=e, **kw)
        self.experts.down_proj = Projection(c.hidden_size, c.moe_intermediate_size, q, experts=e, **kw)
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob

    def e4m3_group(self, rows: int, ops) -> int:
        """0, as they are: the router reads the activations too, and the fused MoE kernel quantizes its own."""
        return 0

    def forward(self, x, ops):
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if gate_up.quant is None:
            return ops.fused_moe(x, F.linear(x, self.gate.weight), gate_up.weight, down.weight, self.top_k,
                                 self.renormalize)
        return ops.fused_moe(x, F.linear(x, self.gate.weight), gate_up.weight, down.weight, self.top_k,
                             self.renormalize, gate_up.scale, down.scale, gate_up.block)


class DecoderLayer(nn.Module):
    """``reduce`` sums a row-parallel output over the tensor-parallel ranks; None at world size 1."""

    def __init__(self, c: ModelConfig, qk_norm: bool, moe: bool, reduce, **kw):
        super().__init__()
        self.self_attn = Attention(c, qk_norm, **kw)
        self.mlp = SparseMoE(c, **kw) if moe else MLP(c, **kw)
        self.input_layernorm, self.post_attention_layernorm = nn.Module(), nn.Module()
        self.input_layernorm.weight = parameter(c.hidden_size, **kw)
        self.post_attention_layernorm.weight = parameter(c.hidden_size, **kw)
        self.eps, self.reduce = c.rms_norm_eps, reduce

    def forward(self, h, residual, positions, cos_sin, kv_layer, slot_mapping, plan, ops, token_ids=None):
        """Each norm hands an FP8 projection after it its rows quantized where that projection takes them so. With
        ``token_ids`` (the first layer's), ``h`` is the embedding table and the first norm takes those rows of it."""
        rows = h.shape[0] if token_ids is None else token_ids.shape[0]
        x, residual = ops.rms_norm(h, self.input_layernorm.weight, self.eps, residual,
                                   e4m3_group=self.self_attn.qkv_proj.e4m3_group(rows, ops), rows=token_ids)
        h = self._summed(self.self_attn(x, positions, cos_sin, kv_layer, slot_mapping, plan, ops))
        x, residual = ops.rms_norm(h, self.post_attention_layernorm.weight, self.eps, residual,
                                   e4m3_group=self.mlp.e4m3_group(rows, ops))
        return self._summed(self.mlp(x, ops)), residual

    def _summed(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.reduce is None else self.reduce(out)


class DecoderLM(nn.Module):
    """Parameters are named as in HF checkpoints (``model.layers.N....``), with q/k/v and gate/up fused.

    ``STACKED`` maps a fused parameter to the checkpoint tensors it is concatenated from, in row order.

    Under a ``quantization`` config every ``Projection`` holds FP8 weights (``quantization.py``); ``quantize_``
    converts a loaded model-dtype model (``--quantization fp8``).

    ``tp`` says which rank of a tensor-parallel model this is: the parameters and the KV pool hold that rank's share
    (``local_config``'s shapes; ``weight_split`` says how each is cut from the full model's) and ``group``, the
    process group of the ranks (None: torch's default group), sums the partial outputs. At world size 1
    ``local_config is config`` and no collective is issued.
    """

    STACKED: dict[str, tuple[str, ...]] = {}
    QK_NORM = False

    def __init__(self, config: ModelConfig, device="cpu", dtype: torch.dtype | None = None,
                 tp: TensorParallel = TensorParallel(), group=None):
        super().__init__()
        tp.check_group(group)
        kw = dict(device=torch.device(device), dtype=dtype or torch_dtype(config.dtype))
        self.config, self.device, self.dtype = config, kw["device"], kw["dtype"]
        self.tp, self.local_config = tp, tp.shard(config)
        reduce = None if tp.world_size == 1 else partial(all_reduce, group=group)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = parameter(config.vocab_size, config.hidden_size, **kw)
        self.model.layers = nn.ModuleList(DecoderLayer(self.local_config, self.QK_NORM, config.is_moe_layer(i), reduce,
                                                       **kw) for i in range(config.num_layers))
        self.model.norm = nn.Module()
        self.model.norm.weight = parameter(config.hidden_size, **kw)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = parameter(config.vocab_size, config.hidden_size, **kw)
        self.register_buffer("cos_sin", cos_sin_cache(config, kw["device"]), persistent=False)
        self.ops = ops_for(kw["device"])

    def quantize_(self, quant: Fp8Config = Fp8Config()) -> None:
        """Every projection (experts included) to e4m3 with ``quant``'s scales, in place: the model then is the one
        an FP8 checkpoint of those weights would load into. Under tensor parallelism each rank quantizes its shard:
        a row-parallel projection's scales are its own columns' (as vLLM's ranks quantize theirs)."""
        for module in self.modules():
            if isinstance(module, Projection):
                module.quantize_(quant)
        self.config = replace(self.config, quantization=quant)
        self.local_config = replace(self.local_config, quantization=quant)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def weight_split(self, name: str) -> Split:
        """How parameter ``name`` (each expert's matrix, for a 3-D one) is cut from the full model's: its parts
        (q/k/v heads, gate and up halves, or the whole tensor) and this rank's slice of each."""
        param = self.get_parameter(name)
        fused = name.split(".")[-2]
        matrix = param[0] if param.dim() == 3 else param
        return weight_split(fused, param.dim() == 3, self.config, self.local_config, matrix.shape[0])

    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """The pool of this rank's KV heads: ``[layers, 2, pages, page_size, local kv_heads, head_dim]``."""
        c = self.local_config
        return (c.num_layers, 2, num_pages, page_size, c.num_kv_heads, c.head_dim)

    def allocate_kv_cache(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The pool in ``dtype``: the model's by default, or e4m3 (``memory.kv_cache_dtype``: the step writes K and
        V rounded to it, saturating at ±448, and attention reads them back exactly)."""
        return torch.zeros(self.kv_cache_shape(num_pages, page_size), device=self.device, dtype=dtype or self.dtype)

    @torch.inference_mode()
    def forward(self, buf, kv_cache: torch.Tensor, num_tokens: int, history: TokenHistory | None = None,
                grammars: torch.Tensor | None = None) -> torch.Tensor:
        """One model step over the first ``num_tokens`` token rows of ``buf`` (a ``StepBuffers``).

        Each row's ``logit_bias`` is added to its logits, then, with ``history`` (the token ids of ``kv_cache``'s
        positions), the step records its tokens there and applies each row's penalties (``buf.penalties``) before
        sampling; without it, penalties are ignored (a model driven outside an engine). With ``grammars`` (the ring's
        grammars region, int32) each row with a grammar state (``buf.grammar_state``) then keeps only the logits of
        the tokens its state allows; without it, grammar states are ignored.

        Writes ``buf.sampled_ids`` / ``buf.sampled_logprobs`` / ``buf.sampled_top_ids`` / ``buf.sampled_top_logprobs``
        for rows with ``logits_indices >= 0`` (others keep their values) and returns the logits
        ``[sample_rows(num_tokens), vocab]`` of the sampled rows in the model's dtype (sampling reads them as they
        are; a float32 copy would cost a pass over them every step).
        """
        c, ops, t = self.local_config, self.ops, num_tokens
        s = buf.layout.sample_rows(t)
        plan = ops.attention_plan(buf, t, c.num_heads, c.num_kv_heads, c.head_dim, kv_cache.shape[3], self.dtype)
        positions, slot_mapping = buf.positions[:t], buf.slot_mapping[:t]
        if history is not None:
            ops.record_tokens(history.tokens, buf.token_ids[:t], slot_mapping)
        # The first layer's norm reads its tokens' rows of the embedding table itself: no lookup launch of its own.
        h, residual = self.model.embed_tokens.weight, None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, positions, self.cos_sin, kv_cache[i], slot_mapping, plan, ops,
                                buf.token_ids[:t] if i == 0 else None)
        rows = buf.logits_indices[:s]
        # Only the sampled rows go through the final norm and the LM head (rows with -1 read row 0, unused).
        h, _ = ops.rms_norm(h, self.model.norm.weight, c.rms_norm_eps, residual, rows=rows)
        logits = F.linear(h, self.lm_head_weight())
        ops.apply_logit_bias(logits, buf.logit_bias_ids[:s], buf.logit_bias[:s], buf.n_logit_bias[:s])
        if history is not None:
            ops.apply_penalties(logits, history.tokens, buf.block_tables[:s], buf.seq_lens[:s], buf.prompt_lens[:s],
                                buf.penalties[:s], history.counts[:s], history.page_size)
        if grammars is not None:
            ops.apply_grammar(logits, grammars, buf.grammar_state[:s])
        out = Sampled(buf.sampled_ids[:s], buf.sampled_logprobs[:s], buf.sampled_top_ids[:s],
                      buf.sampled_top_logprobs[:s])
        sample(logits, buf.temperature[:s], buf.top_k[:s], buf.top_p[:s], buf.min_p[:s], buf.seed[:s],
               buf.seq_lens[:s], ops, out, rows)
        return logits
