"""``logit_bias``: per-row additive biases of chosen tokens, in torch with fixed shapes and no host read, so the same
code runs on the CPU and in a captured CUDA graph (a gather and a scatter of ``[S, max_logit_bias]`` entries)."""
from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor, count: torch.Tensor) -> None:
    """Add ``bias[r, j]`` to the logit of token ``ids[r, j]`` of row ``r`` of ``logits [S, V]``, in place, for ``j <
    count[r]`` and ids in ``[0, V)`` (others are ignored; a row's ids are distinct). The sum is taken in float32 and
    rounded once to the logits' dtype. Fixed shapes, no host read: the CUDA step runs it too."""
    if ids.shape[1] == 0:       # a ring without logit_bias (the shape is fixed: a captured graph has no branch)
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
