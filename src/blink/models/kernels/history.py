"""The step's tokens recorded at their KV positions in Triton (``TokenHistory.tokens``, read by the penalties);
reference: ``reference.record_tokens``.

One launch where torch's version (a comparison, a ``where`` and an indexed store) took three: programs of
``BLOCK`` token rows each store a row's token id at its ``slot_mapping`` entry; padding rows (-1) store nothing (the
reference sends them to the history's last entry, which nothing reads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

BLOCK = 256


@triton.jit
def _record_tokens_kernel(tokens_ptr, ids_ptr, slot_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = t < n
    # Step buffers: read before the wait.
    slot = tl.load(slot_ptr + t, mask=inside, other=-1)
    ids = tl.load(ids_ptr + t, mask=inside, other=0)
    wait_for_previous(PDL)  # the history is written only after the kernels ahead of this one
    tl.store(tokens_ptr + tl.where(slot >= 0, slot, 0).to(tl.int64), ids, mask=slot >= 0)


def record_tokens(tokens: torch.Tensor, token_ids: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As ``reference.record_tokens``: int32 ``tokens``, int32 ``token_ids [T]`` and ``slot_mapping [T]``."""
    n = token_ids.shape[0]
    _record_tokens_kernel[(triton.cdiv(n, BLOCK),)](tokens, token_ids, slot_mapping, n, BLOCK=BLOCK,
                                                    **pdl_args(tokens.device))
