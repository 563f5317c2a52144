"""Host-side writer of the step buffers: what the GPU batcher does, for the CPU path, tests and benchmarks.

It writes every buffer a step of ``T`` tokens reads, padding included, so the invariants listed in
``blink.device.step`` hold whatever the previous step left behind.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: query ``tokens`` at positions ``start ..`` after ``start`` cached tokens.

    ``pages`` is the block table (it must cover ``start + len(tokens)`` positions). ``sample`` says whether the
    last token's logits are sampled (false for a prefill chunk that stops short of the prompt's end).
    """

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    sample: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("SeqChunk.tokens must not be empty")
        if self.start < 0:
            raise ValueError(f"SeqChunk.start must be >= 0 (got {self.start})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SeqChunk.top_p must be in (0, 1] (got {self.top_p})")

    @property
    def seq_len(self) -> int:
        return self.start + len(self.tokens)


def fill_step(buf, chunks: Sequence[SeqChunk], page_size: int) -> int:
    """Write ``chunks`` (in row order) into ``buf`` (a ``StepBuffers``); returns the number of token rows used."""
    layout = buf.layout
    if len(chunks) > layout.max_num_seqs:
        raise ValueError(f"{len(chunks)} sequences exceed max_num_seqs={layout.max_num_seqs}")
    total = sum(len(c.tokens) for c in chunks)
    if total > layout.max_num_batched_tokens:
        raise ValueError(f"{total} tokens exceed max_num_batched_tokens={layout.max_num_batched_tokens}")
    host = {name: torch.zeros(shape, dtype=getattr(torch, dtype.name))
            for name, (shape, dtype) in layout.fields().items()}
    host["slot_mapping"].fill_(-1)
    host["logits_indices"].fill_(-1)
    host["top_p"].fill_(1.0)
    host["penalties"][:, 2] = 1.0                 # repetition 1: no penalties (presence and frequency 0)
    host["num_seqs"][0] = len(chunks)
    row = 0
    for i, c in enumerate(chunks):
        n_pages = -(-c.seq_len // page_size)
        if len(c.pages) < n_pages:
            raise ValueError(f"sequence {i}: {len(c.pages)} pages cannot hold {c.seq_len} positions")
        if n_pages > layout.max_pages_per_seq:
            raise ValueError(f"sequence {i}: {n_pages} pages exceed max_pages_per_seq={layout.max_pages_per_seq}")
        positions = torch.arange(c.start, c.seq_len)
        pages = torch.tensor(list(c.pages[:n_pages]), dtype=torch.int64)
        rows = slice(row, row + len(c.tokens))
        host["token_ids"][rows] = torch.tensor(list(c.tokens))
        host["positions"][rows] = positions
        host["slot_mapping"][rows] = pages[positions // page_size] * page_size + positions % page_size
        host["block_tables"][i, :n_pages] = pages
        host["seq_lens"][i] = c.seq_len
        row += len(c.tokens)
        host["logits_indices"][i] = row - 1 if c.sample else -1
        for name in ("temperature", "top_p", "top_k", "seed"):
            host[name][i] = getattr(c, name)
    host["query_start_loc"][1:] = torch.cumsum(
        torch.tensor([len(c.tokens) for c in chunks] + [0] * (layout.max_num_seqs - len(chunks))), 0)
    host["attn_query_start_loc"], host["attn_seq_lens"] = host["query_start_loc"], host["seq_lens"]   # no drafts
    for name, value in host.items():
        if name not in ("sampled_ids", "sampled_logprobs"):
            getattr(buf, name).copy_(value)
    return total


def chunk_drafts(buf, groups: list[tuple[int, int]]) -> None:
    """Attention's view of each group ``(first, end)`` of rows that ``fill_step`` wrote as one sequence's last token
    and its drafts, one token a row: one chunk in row ``first``, rows ``first + 1 .. end - 1`` empty (``step.py``),
    as the scheduler writes it on the device (``device/inputs.py``). Row ``first`` takes the last row's block table:
    the chunk reads the drafts' pages, and on the device every row of a sequence holds all of its pages."""
    for first, end in groups:
        buf.block_tables[first] = buf.block_tables[end - 1]
        buf.attn_seq_lens[first] = buf.seq_lens[end - 1]
        buf.attn_query_start_loc[first + 1:end] = buf.query_start_loc[end]
        buf.attn_seq_lens[first + 1:end] = 0
