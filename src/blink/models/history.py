"""The token ids a model step's KV pool holds, for the sampling penalties.

Every step records its query tokens at their KV positions (``ops.record_tokens``: ``tokens[slot_mapping[t]] =
token_ids[t]``), before sampling, so a row's whole history (prompt and the outputs fed back so far) is readable
through its block table: position ``p`` of row ``r`` is ``tokens[block_tables[r, p // page_size] * page_size + p %
page_size]``. Pages shared through the prefix cache hold the same tokens for every row that holds them, so they need
no copy. ``counts`` is ``ops.apply_penalties``' scratch: zero between steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_BYTES = 4     # one int32 per KV position


@dataclass(frozen=True)
class TokenHistory:
    """``tokens`` [num_pages * page_size + 1] int32 (the last entry takes the reference's writes of padding rows,
    so recording needs no data-dependent shape); ``counts`` [rows, vocab] int32, all zero."""

    tokens: torch.Tensor
    counts: torch.Tensor
    page_size: int

    @staticmethod
    def scratch(rows: int, vocab: int, device) -> torch.Tensor:
        """The penalties' scratch for ``rows`` sampled rows of a ``vocab``-wide LM head."""
        return torch.zeros(rows, vocab, dtype=torch.int32, device=device)

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, counts: torch.Tensor) -> TokenHistory:
        tokens = torch.zeros(num_pages * page_size + 1, dtype=torch.int32, device=counts.device)
        return cls(tokens, counts, page_size)
