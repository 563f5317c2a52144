"""Torch references of every kernel: the specification the Triton kernels are tested against, and the CPU path (the
sampler's are in ``sampling_reference.py``, imported here under the same names).

These run eagerly and may read step metadata on the host (``attention_plan`` does), so they are for the CPU
simulator and for tests, never for a captured CUDA graph. Shapes follow the flat packed batch of
``blink.device.step``: ``T`` token rows, ``S`` sequence rows; a KV cache layer is ``[2, pages, page_size, kv_heads,
head_dim]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..e4m3 import FP8, FP8_MAX, QuantizedRows, dequantize, quantize_activations
from .sampling_reference import (candidate_threshold, gumbel_argmax, row_logsumexp,  # noqa: F401 (ops of OPS)
                                 sampling_params, store_sampled, top_candidates)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             e4m3_group: int = 0, rows: torch.Tensor | None = None):
    """``x`` (+ ``residual``) normalised over the last dim, times ``weight``; returns ``(out, x + residual)``, ``out``
    quantized per token and ``e4m3_group`` columns (``QuantizedRows``) when given. With ``rows`` (int; -1 reads row
    0) only those rows of ``x`` and ``residual``, in that order: the step's sampled rows into the final norm.

    The sum is rounded to ``x.dtype`` before normalising, as HF's decoder layers do.
    """
    if rows is not None:
        taken = rows.clamp(min=0).long()
        x, residual = x[taken], residual[taken] if residual is not None else None
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (_quantized(out, e4m3_group) if e4m3_group else out), x


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, e4m3_group: int = 0):
    """``x = [gate | up]`` along the last dim → ``silu(gate) * up`` (written into ``out`` when given), quantized per
    token and ``e4m3_group`` columns (``QuantizedRows``) when given."""
    gate, up = x.chunk(2, dim=-1)
    if e4m3_group:
        return _quantized(F.silu(gate) * up, e4m3_group)
    return F.silu(gate) * up if out is None else torch.mul(F.silu(gate), up, out=out)


def _quantized(x: torch.Tensor, group: int) -> QuantizedRows:
    return QuantizedRows(*quantize_activations(x, group), x.dtype)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Qwen3-MoE's router: softmax over the experts in float32, the ``top_k`` largest, renormalised to sum to 1
    when ``renormalize`` (``norm_topk_prob``), then rounded to the logits' dtype. ``router_logits [T, E]`` →
    (weights ``[T, top_k]``, expert ids int64 ``[T, top_k]``), largest weight first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` with ``expert_e(x) = down[e] @ silu_and_mul(gate_up[e] @ x)``,
    accumulated in ``x.dtype`` expert by expert in ascending order, as HF does. ``x [T, H]``, ``gate_up [E, 2I, H]``,
    ``down [E, H, I]``."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(silu_and_mul(F.linear(x[token], gate_up[e])), down[e])
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
              renormalize: bool, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """A mixture-of-experts MLP: ``route`` then ``moe_experts``. ``x [T, H]`` → ``[T, H]``. FP8 experts (with
    scales, as ``fp8_linear`` takes them) are dequantized to ``x.dtype`` first."""
    weights, ids = route(router_logits, top_k, renormalize)
    if gate_up_scale is not None:
        gate_up = dequantize(gate_up, gate_up_scale, block).to(x.dtype)
        down = dequantize(down, down_scale, block).to(x.dtype)
    return moe_experts(x, weights, ids, gate_up, down)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` of model-dtype weights: one GEMM."""
    return F.linear(x, weight)


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """``x @ W.T`` for e4m3 ``weight [N, K]`` with its float32 scales (per row ``[N]``, or per ``block``
    ``[N/bn, K/bk]``): the weights dequantized to ``x.dtype``, then one GEMM. Activations are not quantized here
    (the CUDA kernels quantize them per token; their tests hold them to this with quantized activations); ones that
    come quantized (``QuantizedRows``) are dequantized first."""
    if isinstance(x, QuantizedRows):
        x = x.dequantized()
    return F.linear(x, dequantize(weight, scale, block).to(x.dtype))


def fp8_takes_e4m3(rows: int, block: tuple[int, int] | None) -> bool:
    """Whether an FP8 projection of ``rows`` rows takes its activations quantized by the kernel before it: never
    here, where activations are multiplied as they are."""
    return False


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate the first ``rotary_dim`` dims of every head of ``q [T, H, D]`` and ``k [T, KH, D]`` in place.

    ``cos_sin [max_pos, rotary_dim]`` holds ``cos`` in its first half and ``sin`` in its second (NeoX / HF layout:
    dim ``j`` pairs with ``j + rotary_dim/2``).
    """
    cs = cos_sin[positions.long()]
    cos, sin = cs.chunk(2, dim=-1)
    for x in (q, k):
        half = cos.shape[-1]
        x1, x2 = x[..., :half].float().clone(), x[..., half:2 * half].float().clone()
        c, s = cos[:, None, :], sin[:, None, :]
        x[..., :half] = (x1 * c - x2 * s).to(x.dtype)
        x[..., half:2 * half] = (x2 * c + x1 * s).to(x.dtype)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor):
    """Store ``k, v [T, KH, D]`` at ``slot_mapping[t]`` of the layer's pool; rows with slot -1 are skipped. An e4m3
    pool takes them rounded to nearest, saturating at ±``FP8_MAX`` (a plain cast gives NaN beyond)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for i, x in enumerate((k, v)):
        x = x[keep]
        if kv_layer.dtype == FP8:
            x = x.float().clamp(-FP8_MAX, FP8_MAX)
        kv_layer[i].view(-1, *x.shape[1:])[slots] = x.to(kv_layer.dtype)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  kv_layer: torch.Tensor, slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                  k_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Per-head RMSNorm of ``q`` and ``k`` when weights are given (Qwen3), RoPE on both, then the KV write of
    ``k`` and ``v``; returns the rotated ``q`` (``q`` and ``k`` may be overwritten)."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps)[0], rms_norm(k, k_weight, eps)[0]
    rope(q, k, positions, cos_sin)
    kv_write(k, v, kv_layer, slot_mapping)
    return q


@dataclass(frozen=True)
class SequencePlan:
    """One sequence's part of a step: its query rows ``start .. start + q_len - 1`` (the last ``q_len`` of its
    ``ctx`` positions) and ``pool_rows``, the rows of a layer's pool flattened to ``[pages * page_size]`` that hold
    its positions ``0 .. ctx - 1`` in order."""

    start: int
    q_len: int
    ctx: int
    pool_rows: torch.Tensor


@dataclass(frozen=True)
class AttentionPlan:
    """The step's sequences with query rows, read once per step on the host (every layer reuses it)."""

    seqs: tuple[SequencePlan, ...]
    num_tokens: int


def attention_plan(buf, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                   dtype: torch.dtype | None = None) -> AttentionPlan:
    """Same signature as the Triton plan; the reference takes heads and dtype from ``q`` instead."""
    n = int(buf.num_seqs[0])
    starts = buf.attn_query_start_loc[:n + 1].tolist()
    lens = buf.attn_seq_lens[:n].tolist()
    offsets = torch.arange(page_size, device=buf.block_tables.device)
    seqs = []
    for i in range(n):
        if starts[i + 1] == starts[i]:
            continue        # a draft row's tokens are in its sequence's first row (step.py)
        pages = buf.block_tables[i, :-(-lens[i] // page_size)].long()
        pool_rows = (pages[:, None] * page_size + offsets).flatten()[:lens[i]]
        seqs.append(SequencePlan(starts[i], starts[i + 1] - starts[i], lens[i], pool_rows))
    return AttentionPlan(tuple(seqs), num_tokens)


def attention(q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float,
              sliding_window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's query rows ``q [T, H, D]`` over its paged context (cached prefix and
    this step's tokens, already written to the pool). A query at position ``p`` sees keys at positions
    ``max(0, p - sliding_window + 1) .. p`` (all of ``0..p`` when ``sliding_window == 0``). Padding rows are 0.
    """
    out = torch.zeros_like(q)
    kv_heads = kv_layer.shape[-2]
    pool = kv_layer.flatten(1, 2)                   # [2, pages * page_size, kv_heads, D]
    for seq in plan.seqs:
        k, v = pool[:, seq.pool_rows].transpose(1, 2).float()[:, :, None]     # each [kv_heads, 1, ctx, D]
        # Query heads h of one KV head are consecutive (h // group): [kv_heads, group, q_len, D].
        qs = q[seq.start:seq.start + seq.q_len].transpose(0, 1).float().unflatten(0, (kv_heads, -1))
        scores = (qs @ k.transpose(-1, -2)) * scale                         # [kv_heads, group, q_len, ctx]
        visible = _visible(seq, sliding_window, q.device)
        if visible is not None:
            scores.masked_fill_(~visible, float("-inf"))
        o = (scores.softmax(-1) @ v).flatten(0, 1)                          # [heads, q_len, D]
        out[seq.start:seq.start + seq.q_len] = o.transpose(0, 1).to(q.dtype)
    return out


def _visible(seq: SequencePlan, sliding_window: int, device) -> torch.Tensor | None:
    """``[q_len, ctx]``: which keys each query row sees; None where it is every key (one query row, the last
    position, with no window or one that covers the whole context)."""
    if seq.q_len == 1 and (not sliding_window or seq.ctx <= sliding_window):
        return None
    q_pos = torch.arange(seq.ctx - seq.q_len, seq.ctx, device=device)[:, None]
    k_pos = torch.arange(seq.ctx, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window:
        visible &= k_pos > q_pos - sliding_window
    return visible


def record_tokens(tokens: torch.Tensor, token_ids: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store a step's query tokens at their KV positions: ``tokens[slot_mapping[t]] = token_ids[t]`` (``tokens``:
    ``TokenHistory.tokens``); rows with ``slot_mapping == -1`` (padding) go to the last entry, which nothing reads
    (a fixed shape: no host read, so it captures)."""
    tokens[torch.where(slot_mapping >= 0, slot_mapping, tokens.numel() - 1)] = token_ids


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor, count: torch.Tensor) -> None:
    """Add ``bias[r, j]`` to the logit of token ``ids[r, j]`` of row ``r`` of ``logits [S, V]``, in place, for ``j <
    count[r]`` and ids in ``[0, V)`` (others are ignored; a row's ids are distinct). The sum is taken in float32 and
    rounded once to the logits' dtype. Fixed shapes, no host read (it captures in a CUDA graph)."""
    if ids.shape[1] == 0:       # a ring without logit_bias
        return
    vocab = logits.shape[1]
    valid = ((torch.arange(ids.shape[1], device=ids.device) < count[:, None]) & (ids >= 0) & (ids < vocab))
    # Entries that add nothing rewrite the row's first valid entry (or, without one, token 0 as it is), so every
    # write of one index stores the same value whatever order the scatter takes.
    first = valid.int().argmax(dim=1, keepdim=True)
    index = torch.where(valid, ids, torch.where(valid.any(dim=1, keepdim=True), ids.gather(1, first), 0)).long()
    x = logits.gather(1, index)
    biased = torch.where(valid, (x.float() + bias).to(logits.dtype), x)
    logits.scatter_(1, index, torch.where(valid, biased, biased.gather(1, first)))


def apply_penalties(logits: torch.Tensor, page_tokens: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, prompt_lens: torch.Tensor, penalties: torch.Tensor, counts: torch.Tensor,
                    page_size: int) -> None:
    """vLLM's penalties, in place on ``logits [S, V]`` (computed in float32). Row ``r``'s history is positions
    ``0 .. seq_lens[r]-1``, position ``p`` holding ``page_tokens[block_tables[r, p // page_size] * page_size +
    p % page_size]``; those below ``prompt_lens[r]`` are its prompt, the rest its output. A token ``t`` in the
    history (ids outside ``[0, V)`` are ignored), ``c`` times in the output, becomes ``x / repetition`` when ``x > 0``
    else ``x * repetition``, then, when ``c > 0``, ``- frequency * c - presence``. Other logits are left as they
    are, all of a row with neutral penalties (0, 0, 1). ``penalties [S, 3]`` holds each row's (presence, frequency,
    repetition); ``counts`` (the Triton kernels' scratch) is not used."""
    presence, frequency, repetition = penalties.unbind(1)
    # Eager code (the CPU step): only the rows with penalties are worked on, over their longest history.
    rows = ((presence != 0) | (frequency != 0) | (repetition != 1)).nonzero()[:, 0]  # a neutral row stays bit for bit
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    seq_lens, prompt_lens = seq_lens[rows], prompt_lens[rows]
    pos = torch.arange(int(seq_lens.max()), device=logits.device)
    history = pos < seq_lens[:, None]
    pages = torch.where(history, block_tables[rows][:, pos // page_size], 0).long()  # entries past the row: anything
    tokens = page_tokens[pages * page_size + pos % page_size].long()
    known = history & (tokens >= 0) & (tokens < vocab)
    output = known & (pos >= prompt_lens[:, None])
    tokens = torch.where(known, tokens, 0)

    def bincount(mask):
        return torch.zeros(len(rows), vocab, dtype=torch.int32, device=logits.device).scatter_add_(1, tokens,
                                                                                                 mask.int())

    count = bincount(output)
    seen = (count > 0) | (bincount(known & ~output) > 0)
    x = logits[rows].float()
    rep = repetition[rows, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = torch.where(count > 0, x - frequency[rows, None] * count - presence[rows, None], x)
    logits[rows] = x.to(logits.dtype)


def grammar_allowed(grammars: torch.Tensor, state: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, vocab]`` bool: the tokens each row's grammar state allows (every token where ``state < 0``). A state is
    a word offset into ``grammars`` (int32) where its mask starts: bit ``t % 32`` of word ``t // 32`` allows ``t``."""
    words = torch.arange((vocab + 31) // 32, device=state.device)
    masks = grammars[state.clamp(min=0).long()[:, None] + words]                       # [S, W]
    token = torch.arange(vocab, device=state.device, dtype=torch.int32)
    return ((masks.index_select(1, (token // 32).long()) >> (token % 32)) & 1).bool() | (state < 0)[:, None]


def apply_grammar(logits: torch.Tensor, grammars: torch.Tensor, state: torch.Tensor) -> None:
    """``kernels.grammar.apply_grammar`` over the rows that have a grammar only, found by a host read (the CPU step's:
    a step without grammars then costs one comparison, not a pass over every row's logits)."""
    rows = (state >= 0).nonzero()[:, 0]
    if len(rows):
        subset = logits[rows]
        subset.masked_fill_(~grammar_allowed(grammars, state[rows], logits.shape[1]), float("-inf"))
        logits[rows] = subset
