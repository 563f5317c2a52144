"""Grammar masks: each row's logits restricted to the tokens its grammar state allows, in torch with fixed shapes
and no host read, so the same code runs on the CPU and in a captured CUDA graph (a gather of each row's mask words,
then of each token's bit)."""
from __future__ import annotations

import torch


def apply_grammar(logits: torch.Tensor, grammars: torch.Tensor, state: torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits of row ``r`` of ``logits [S, V]`` whose tokens the grammar state
    ``state[r]`` does not allow (rows with ``state[r] < 0`` are left as they are). A state is a word offset into
    ``grammars`` (int32, the ring's grammars region) where its token mask starts: ``ceil(V / 32)`` words, bit
    ``t % 32`` of word ``t // 32`` allowing token ``t`` (``blink.ring.grammar``)."""
    vocab = logits.shape[1]
    words = torch.arange((vocab + 31) // 32, device=logits.device)
    masks = grammars[state.clamp(min=0).long()[:, None] + words]                       # [S, W]
    token = torch.arange(vocab, device=logits.device, dtype=torch.int32)
    allowed = ((masks.index_select(1, (token // 32).long()) >> (token % 32)) & 1).bool() | (state < 0)[:, None]
    logits.masked_fill_(~allowed, float("-inf"))


def apply_grammar_rows(logits: torch.Tensor, grammars: torch.Tensor, state: torch.Tensor) -> None:
    """``apply_grammar`` on the rows that have a grammar only, found by a host read: the CPU step's (a step without
    grammars then costs one comparison, not a pass over every row's logits)."""
    rows = (state >= 0).nonzero()[:, 0]
    if len(rows):
        subset = logits[rows]
        apply_grammar(subset, grammars, state[rows])
        logits[rows] = subset
