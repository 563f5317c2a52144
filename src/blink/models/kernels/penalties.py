"""vLLM's sampling penalties in Triton, applied in place to a step's logits; reference: ``reference.apply_penalties``.

A row's history is read from the pool of token ids through its block table, so nothing is gathered on the host and
the launch shapes depend only on the buffers' shapes (capturable in a CUDA graph). Two launches over the same grid,
program ``(row, chunk)`` covering ``CHUNK`` history positions of the row:

- ``_count_kernel`` tallies the row's history in the ``counts [S, V]`` scratch: +1 per output position, bit
  ``PROMPT_BIT`` for a prompt position (a count cannot reach it: histories are far shorter than 2**30).
- ``_apply_kernel`` swaps each history token's tally for 0 (``atomic_xchg``): only the one lane that gets it non-zero
  adjusts that logit, so a token is penalised once however often it repeats, and the scratch is all zero again
  afterwards without an [S, V] clear each step. The launch boundary orders the phases, so the atomics are relaxed.

Rows with neutral penalties, and chunks past a row's length, return at once in both kernels (the same test in both,
so the second clears exactly what the first wrote): most rows of most steps have no penalties.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

CHUNK = 4096
BLOCK = 1024
PROMPT_BIT = 30


@triton.jit
def _row_penalties(penalties_ptr, penalties_stride, row):
    """The row's (presence, frequency, repetition)."""
    at = penalties_ptr + row * penalties_stride
    return tl.load(at), tl.load(at + 1), tl.load(at + 2)


@triton.jit
def _row_span(seq_lens_ptr, penalties_ptr, penalties_stride, row, chunk, CHUNK: tl.constexpr):
    """(first, end) of the history positions of program ``(row, chunk)``; empty for a row whose penalties are
    neutral or a chunk past the row's length."""
    presence, frequency, repetition = _row_penalties(penalties_ptr, penalties_stride, row)
    neutral = (presence == 0) & (frequency == 0) & (repetition == 1)
    first = chunk * CHUNK
    end = tl.where(neutral, first, tl.minimum(first + CHUNK, tl.load(seq_lens_ptr + row)))
    return first, end


@triton.jit
def _history_tokens(page_tokens_ptr, block_tables_ptr, row, bt_stride, pos, end, page_size, vocab):
    """Token ids at ``pos`` of the row and whether each is a history position holding an id in ``[0, vocab)``."""
    in_history = pos < end
    page = tl.load(block_tables_ptr + row * bt_stride + pos // page_size, mask=in_history, other=0)
    tok = tl.load(page_tokens_ptr + page * page_size + pos % page_size, mask=in_history, other=-1)
    return tok, in_history & (tok >= 0) & (tok < vocab)


@triton.jit
def _count_kernel(page_tokens_ptr, block_tables_ptr, seq_lens_ptr, prompt_lens_ptr, penalties_ptr, counts_ptr, vocab,
                  bt_stride, penalties_stride, counts_stride, page_size, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  PROMPT_BIT: tl.constexpr, PDL: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    first, end = _row_span(seq_lens_ptr, penalties_ptr, penalties_stride, row, chunk, CHUNK)
    if first >= end:
        return
    prompt_len = tl.load(prompt_lens_ptr + row)
    for start in range(first, end, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        tok, ok = _history_tokens(page_tokens_ptr, block_tables_ptr, row, bt_stride, pos, end, page_size, vocab)
        tally = counts_ptr + row * counts_stride + tok
        tl.atomic_add(tally, 1, mask=ok & (pos >= prompt_len), sem="relaxed")
        tl.atomic_or(tally, 1 << PROMPT_BIT, mask=ok & (pos < prompt_len), sem="relaxed")


@triton.jit
def _apply_kernel(page_tokens_ptr, block_tables_ptr, seq_lens_ptr, penalties_ptr, counts_ptr, logits_ptr, vocab,
                  bt_stride, penalties_stride, counts_stride, logits_stride, page_size, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr, PROMPT_BIT: tl.constexpr, PDL: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    first, end = _row_span(seq_lens_ptr, penalties_ptr, penalties_stride, row, chunk, CHUNK)
    if first >= end:
        return
    presence, frequency, repetition = _row_penalties(penalties_ptr, penalties_stride, row)
    for start in range(first, end, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        tok, ok = _history_tokens(page_tokens_ptr, block_tables_ptr, row, bt_stride, pos, end, page_size, vocab)
        tally = tl.atomic_xchg(counts_ptr + row * counts_stride + tok, 0, mask=ok, sem="relaxed")
        first_seen = ok & (tally != 0)  # a masked lane's result is undefined: only the mask makes it meaningful
        count = tally & ((1 << PROMPT_BIT) - 1)
        ptr = logits_ptr + row * logits_stride + tok
        x = tl.load(ptr, mask=first_seen, other=0.0).to(tl.float32)
        # Every seen token, prompt or output, gets the repetition penalty; div_rn: the division torch does.
        x = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
        x = tl.where(count > 0, x - frequency * count.to(tl.float32) - presence, x)
        tl.store(ptr, x.to(logits_ptr.dtype.element_ty), mask=first_seen)


def apply_penalties(logits: torch.Tensor, page_tokens: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, prompt_lens: torch.Tensor, penalties: torch.Tensor, counts: torch.Tensor,
                    page_size: int) -> None:
    """As ``reference.apply_penalties``; ``logits [S, V]``, ``penalties [S, 3]`` and ``counts [S, V]`` int32 (all
    zero on entry, all zero again on return) have unit stride in their last dimension (rows at any stride).
    Histories may be as long as the block tables hold."""
    assert logits.stride(1) == penalties.stride(1) == counts.stride(1) == 1, "unit stride in the last dimension"
    rows, vocab = logits.shape
    grid = (rows, triton.cdiv(block_tables.shape[1] * page_size, CHUNK))
    consts = {"CHUNK": CHUNK, "BLOCK": BLOCK, "PROMPT_BIT": PROMPT_BIT, "num_warps": 4, **pdl_args(logits.device)}
    _count_kernel[grid](page_tokens, block_tables, seq_lens, prompt_lens, penalties, counts, vocab,
                        block_tables.stride(0), penalties.stride(0), counts.stride(0), page_size, **consts)
    _apply_kernel[grid](page_tokens, block_tables, seq_lens, penalties, counts, logits, vocab, block_tables.stride(0),
                        penalties.stride(0), counts.stride(0), logits.stride(0), page_size, **consts)
