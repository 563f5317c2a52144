"""In-step sampling: greedy, temperature, top-k, top-p and per-request seeds, all per row, with fixed shapes.

Everything here has shapes fixed by the bucket, so it captures into the step graph. Filters become one threshold per
row (tokens whose scaled logit is ``>=`` it stay), found among the ``CANDIDATES`` largest logits:

- ``top_k`` above ``CANDIDATES`` acts as ``CANDIDATES``;
- top-p keeps the smallest prefix of the (top-k filtered, renormalised) candidates whose mass reaches ``top_p``, as
  HF's warpers do; when even all ``CANDIDATES`` fall short of ``top_p`` (and top-k is off) the row is not truncated.

The token is then ``argmax(logit / T + gumbel)`` (Gumbel-max draws exactly from the softmax), with the noise a hash of
``(seed, seq_len, token)``. The returned logprob is of the distribution the logits give (after the penalties, which
the step applies to them first, and before temperature or filters).
The scaled logits ``logit / T`` are never stored: the kernels divide as they read (``ops.row_logsumexp`` gives both
rows' log-sum-exps in one pass, ``ops.candidate_threshold`` applies the filters to the top logits, scaled, since
dividing by a positive ``T`` keeps their order, and ``ops.gumbel_argmax`` picks the token).
"""
from __future__ import annotations

import torch

CANDIDATES = 1024


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, seq_lens: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [S, V]`` (the model's dtype: the kernels read it as it is and compute in float32) → (token ids int32
    ``[S]``, their logprobs float32 ``[S]``)."""
    greedy = temperature <= 0
    divisor = torch.where(greedy, 1.0, temperature)
    lse, lse_scaled = ops.row_logsumexp(logits, divisor)
    threshold = filter_threshold(logits, divisor, lse_scaled, top_k, top_p, ops)
    ids = ops.gumbel_argmax(logits, divisor, threshold, seed, seq_lens, greedy)
    logprobs = logits.gather(1, ids[:, None].long())[:, 0].float() - lse
    return ids, logprobs


def filter_threshold(logits: torch.Tensor, divisor: torch.Tensor, lse_scaled: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, ops) -> torch.Tensor:
    """Smallest scaled logit (``logits / divisor``, ``divisor > 0``) each row keeps (``-inf`` keeps all);
    ``lse_scaled`` is the log-sum-exp of each scaled row."""
    n = min(CANDIDATES, logits.shape[1])
    # Converting to float32 is exact and keeps the order, so the top of the model-dtype row is the same set of values
    # (half the bytes to search in bf16).
    return ops.candidate_threshold(torch.topk(logits, n, dim=1).values, divisor, lse_scaled, top_k, top_p)
