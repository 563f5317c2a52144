"""Paged attention in Triton for any mix of prefill chunks and decodes; reference: ``reference.attention``.

One launch serves the whole packed batch, so its grid depends only on the bucket: program ``(kv_head, b, split)``
takes query block ``b`` (``BLOCK_Q`` query tokens of one sequence, times the ``GROUP`` query heads sharing
``kv_head``: GQA loads each K/V tile once for the whole group) and attends causally over split ``split`` of the
keys its block can see (cached prefix plus this step's tokens, read through the block table). The blocks follow
``attn_query_start_loc`` (``qsl``: attention's view of the bucket's ``S`` rows, ``step.py``; a sequence verifying
drafts is one chunk there, its other rows empty): block ``b < S`` is row ``b``'s last query block, found without a
search (an empty row's exits without one: most of a verification's rows are empty); the ``T // BLOCK_Q`` blocks after
them hold the sequences' other blocks, sequence ``i``'s ``cdiv(len_i, BLOCK_Q) - 1`` from block ``S + qsl[i] //
BLOCK_Q`` on (these runs never overlap, and a binary search over ``qsl`` finds a block's), each sequence's second
last first; surplus programs exit after the search.
With one split it writes the output; with several (decode-heavy buckets: long contexts and few sequences would
leave most SMs idle) each split writes a partial output and its log-sum-exp, and ``_combine_kernel`` merges them.
Rows past the batch's last token stay 0.
The launch shape (rows per query block, keys per iteration, warps, stages) is a ``Tiles``; ``tiles_for`` picks it
per bucket and ``bench/attention_bench.py --sweep`` times others.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous
from .tiles import check_tiles
from .widen import widen

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension, which counts query blocks


@triton.jit
def _find_seq(qsl_ptr, extra, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` with ``qsl[i] // BLOCK_Q <= extra``: the one whose run of other blocks holds ``extra``
    if any does (the module docstring)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q <= extra:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend(acc, m_i, l_i, q, cache_ptr, bt_ptr, seq, bt_stride, v_offset, kv_head, num_kv_heads, head_dim, qk_scale,
            q_pos, window, start, stop, d, d_ok, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Online softmax (base 2: ``qk_scale`` holds log2(e)) of ``q`` over keys ``[start, stop)``, ``BLOCK_N`` at a
    time. Unmasked (``MASKED`` false) only where every row sees every key and ``stop - start`` is a multiple of
    ``BLOCK_N``: the causal and window comparisons then cost nothing."""
    for block_start in range(start, stop, BLOCK_N):
        n = block_start + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        page = tl.load(bt_ptr + seq * bt_stride + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv = ((page * PAGE_SIZE + n % PAGE_SIZE) * num_kv_heads + kv_head) * head_dim
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = widen(tl.load(cache_ptr + kv[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)  # e4m3: exact
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible &= n[None, :] > q_pos[:, None] - window
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: 2^-inf = 0, no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = widen(tl.load(cache_ptr + v_offset + kv[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_kernel(q_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
                      num_seqs_ptr, num_rows, q_st, q_sh, bt_stride, v_offset, scale, window, num_heads,
                      num_kv_heads, head_dim, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr):
    kv_head, block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # The batch's layout comes from step buffers, so it is read before waiting for the previous kernel (q, K, V).
    num_seqs = tl.load(num_seqs_ptr)
    extra = block - num_rows
    if extra < 0:
        seq = tl.where(block < num_seqs, block, -1)
    else:
        seq = _find_seq(qsl_ptr, extra, num_seqs, BLOCK_Q)
    found = tl.maximum(seq, 0)
    q_start = tl.load(qsl_ptr + found)
    q_len = tl.load(qsl_ptr + found + 1) - q_start
    prefix = tl.load(seq_lens_ptr + found) - q_len
    wait_for_previous(PDL)
    if seq < 0:
        return
    # Every sequence's last query block first, then the others, each sequence's from its second last down: the GPU
    # starts programs in grid order (kv_head fastest), so the longest causal rows start first.
    local = tl.cdiv(q_len, BLOCK_Q) - 1 - tl.where(extra < 0, 0, 1 + extra - q_start // BLOCK_Q)
    if local < 0:
        return

    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    q_local = local * BLOCK_Q + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_local < q_len) & (rows % GROUP_P2 < GROUP)
    q_pos = prefix + q_local
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    token = q_start + q_local
    q = tl.load(q_ptr + token[:, None] * q_st + head[:, None] * q_sh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys this block can see: up to its last query's position, back to its first query's window.
    hi = prefix + tl.minimum((local + 1) * BLOCK_Q, q_len)
    lo = tl.where(window > 0, tl.maximum(0, prefix + local * BLOCK_Q - window + 1), 0)
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_lo = lo + split * chunk
    split_hi = tl.minimum(hi, split_lo + chunk)
    # Whole key blocks below the block's first query position are visible to every row (without a window).
    full_hi = split_lo
    if not HAS_WINDOW:
        full_hi += tl.maximum(tl.minimum(split_hi, prefix + local * BLOCK_Q + 1) - split_lo, 0) // BLOCK_N * BLOCK_N

    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
    m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, BLOCK_D], tl.float32)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, cache_ptr, bt_ptr, seq, bt_stride, v_offset, kv_head, num_kv_heads,
                            head_dim, qk_scale, q_pos, window, split_lo, full_hi, d, d_ok, BLOCK_N, PAGE_SIZE,
                            False, HAS_WINDOW)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, cache_ptr, bt_ptr, seq, bt_stride, v_offset, kv_head, num_kv_heads,
                            head_dim, qk_scale, q_pos, window, full_hi, split_hi, d, d_ok, BLOCK_N, PAGE_SIZE,
                            True, HAS_WINDOW)

    l_safe = tl.where(l_i == 0, 1.0, l_i)
    o = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (token[:, None] * num_heads + head[:, None]) * head_dim + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # back to base e for _combine_kernel
        tl.store(part_o_ptr + part[:, None] * head_dim + d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + part, tl.where(l_i == 0, float("-inf"), lse), mask=row_ok)


@triton.jit
def _combine_kernel(out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, num_seqs_ptr, num_heads, head_dim,
                    NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    padding = token >= tl.load(qsl_ptr + tl.load(num_seqs_ptr))  # step buffers: read before the wait
    wait_for_previous(PDL)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (token * num_heads + head) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + part)
    top = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(part_o_ptr + part[:, None] * head_dim + d[None, :], mask=d[None, :] < head_dim, other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(total == 0, 1.0, total)
    if padding:  # no program wrote the partials of padding rows
        o = tl.zeros([BLOCK_D], tl.float32)
    tl.store(out_ptr + (token * num_heads + head) * head_dim + d, o.to(out_ptr.dtype.element_ty), mask=d < head_dim)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of ``_attention_kernel``: ``query_rows`` rows of Q per program (query tokens times the GQA group
    padded to a power of two; a larger group takes one token per program), ``block_n`` keys per loop iteration, and
    Triton's warps and software-pipeline stages."""

    query_rows: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(self)


def tiles_for(num_tokens: int, max_num_seqs: int, decode_query_len: int = 1) -> Tiles:
    """Decode-sized buckets (every token may be a sequence of its own) take 16-row blocks (a decode has one query
    token) and 3 pipeline stages; prefill buckets 64-row blocks and 2 stages, and so do decode-sized buckets where a
    sequence may bring its drafts (``decode_query_len`` > 1, ``StepLayout``'s): a block then holds, e.g., a sequence's
    token and 4 drafts times a GQA group of 4 (20 of its 64 rows), so it reads their K/V once. Both 64 keys per
    iteration and 4 warps.

    From ``bench/attention_bench.py --sweep`` on the H200 (c160fdc, Llama-3-8B's heads): 2 stages instead of 3 took a
    2048-token prompt from 134.5 to 122.4 us per layer and a 512-token chunk on a 1536-token prefix from 58.5 to 55.7
    us (128-row blocks of 32 keys: the prompt in 115 us, the chunk in 98 us); for decodes 2 stages gained <= 0.6 us in
    the sweep but Llama-3-8B's B=16 8K decode step took 10.5 ms against 9.2 with 3. On an H100 (Qwen3-8B, 1K
    context, ``bench/model_bench.py --drafts 4``, 7695e38 against 7df6e3c) 64-row blocks took the attention of 16 / 64
    sequences verifying 4 drafts each from 1.87 / 4.67 to 1.57 / 4.31 ms a step (16-row blocks: a 5-token chunk in
    two, each reading the context; 32-row blocks did less, docs/benchmarks/speculation.md), where one-token rows in
    them cost 3-7 % more than in 16-row blocks (``attention_bench``: 35.6 against 33.3 us a layer at B = 16, 98.5
    against 95.1 at B = 64)."""
    if num_tokens <= max_num_seqs and decode_query_len == 1:
        return Tiles(query_rows=16, num_stages=3)
    return Tiles(query_rows=64)


@dataclass(frozen=True)
class AttentionPlan:
    """Launch shape of one step's attention (fixed per bucket) and the buffers all layers share.

    ``num_rows`` is the bucket's sequence rows (its first ``num_rows`` query blocks are each row's last);
    ``out`` is zeroed once per step; each layer overwrites the same live rows, so padding rows stay 0.
    """

    buf: object
    num_tokens: int
    tiles: Tiles
    block_q: int
    num_rows: int
    num_blocks: int
    num_splits: int
    out: torch.Tensor
    part_o: torch.Tensor | None
    part_lse: torch.Tensor | None


def multiprocessors(device: torch.device) -> int:
    """The SMs the default split count fills: ``device``'s, or 4 off CUDA (the interpreter walks few splits)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def attention_plan(buf, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                   dtype: torch.dtype | None = None, num_splits: int | None = None,
                   tiles: Tiles | None = None) -> AttentionPlan:
    """``num_splits`` defaults to enough splits for about two programs per SM when every sequence decodes;
    ``tiles`` to ``tiles_for`` the bucket."""
    device, layout = buf.token_ids.device, buf.layout
    seqs = layout.sample_rows(num_tokens)
    tiles = tiles or tiles_for(num_tokens, layout.max_num_seqs, layout.decode_query_len)
    block_q = max(1, tiles.query_rows // triton.next_power_of_2(num_heads // num_kv_heads))
    if num_splits is None:
        sms = multiprocessors(device)
        num_splits = min(32, triton.next_power_of_2(triton.cdiv(2 * sms, seqs * num_kv_heads)))
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two (got {num_splits})")
    num_blocks = num_tokens // block_q + seqs  # query blocks: see the module docstring
    if num_blocks > MAX_GRID_Y:
        raise ValueError(f"{num_blocks} query blocks of {block_q} tokens exceed the launch grid's {MAX_GRID_Y}: "
                         f"use larger Tiles.query_rows or a smaller bucket (num_tokens={num_tokens})")
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=dtype or torch.bfloat16, device=device)
    part_o = part_lse = None
    if num_splits > 1:
        part_o = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=device)
    return AttentionPlan(buf, num_tokens, tiles, block_q, seqs, num_blocks, num_splits, out, part_o, part_lse)


def attention(q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float,
              sliding_window: int = 0) -> torch.Tensor:
    """``q [T, H, D]`` (unit stride in D), ``kv_layer [2, pages, page_size, KH, D]`` contiguous → ``[T, H, D]``."""
    buf, t = plan.buf, plan.num_tokens
    heads, kv_heads, dim, page_size = q.shape[1], kv_layer.shape[3], q.shape[2], kv_layer.shape[2]
    group = heads // kv_heads
    grid = (kv_heads, plan.num_blocks, plan.num_splits)
    block_d = triton.next_power_of_2(dim)
    pdl = pdl_args(q.device)
    _attention_kernel[grid](
        q, kv_layer, plan.out, plan.part_o, plan.part_lse, buf.attn_query_start_loc, buf.attn_seq_lens,
        buf.block_tables, buf.num_seqs, plan.num_rows, q.stride(0), q.stride(1), buf.block_tables.stride(0),
        kv_layer[0].numel(), scale, sliding_window, heads, kv_heads, dim, GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        BLOCK_Q=plan.block_q, BLOCK_N=plan.tiles.block_n, BLOCK_D=block_d, PAGE_SIZE=page_size,
        NUM_SPLITS=plan.num_splits, HAS_WINDOW=sliding_window > 0, num_warps=plan.tiles.num_warps,
        num_stages=plan.tiles.num_stages, **pdl)
    if plan.num_splits > 1:
        _combine_kernel[(t, heads)](plan.out, plan.part_o, plan.part_lse, buf.attn_query_start_loc, buf.num_seqs,
                                    heads, dim, NUM_SPLITS=plan.num_splits, BLOCK_D=block_d, **pdl)
    return plan.out
