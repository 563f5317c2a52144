"""Grammar masks: each row's logits restricted to the tokens its grammar state allows, in torch with fixed shapes
and no host read, so the same code runs on the CPU and in a captured CUDA graph (a gather of ``[S, V]`` mask bits)."""
from __future__ import annotations

import torch


def apply_grammar(logits: torch.Tensor, grammars: torch.Tensor, state: torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits of row ``r`` of ``logits [S, V]`` whose tokens the grammar state
    ``state[r]`` does not allow (rows with ``state[r] < 0`` are left as they are). A state is a word offset into
    ``grammars`` (int32, the ring's grammars region) where its token mask starts: ``ceil(V / 32)`` words, bit
    ``t % 32`` of word ``t // 32`` allowing token ``t`` (``blink.ring.grammar``)."""
    vocab = logits.shape[1]
    token = torch.arange(vocab, device=logits.device, dtype=torch.int32)
    words = grammars[state.clamp(min=0).long()[:, None] + (token // 32).long()]      # [S, V]: each token's word
    allowed = ((words >> (token % 32)) & 1).bool() | (state < 0)[:, None]
    logits.masked_fill_(~allowed, float("-inf"))
