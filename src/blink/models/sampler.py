"""In-step sampling: greedy, temperature, top-k, top-p and per-request seeds, all per row, with fixed shapes.

Everything here has shapes fixed by the bucket, so it captures into the step graph. Filters become one threshold per
row (tokens whose scaled logit is ``>=`` it stay), found among the ``CANDIDATES`` largest logits:

- ``top_k`` above ``CANDIDATES`` acts as ``CANDIDATES``;
- top-p keeps the smallest prefix of the (top-k filtered, renormalised) candidates whose mass reaches ``top_p``, as
  HF's warpers do; when even all ``CANDIDATES`` fall short of ``top_p`` (and top-k is off) the row is not truncated.

The token is then ``argmax(logit / T + gumbel)`` (Gumbel-max draws exactly from the softmax), with the noise a hash of
``(seed, seq_len, token)``. The returned logprob is of the model's own distribution (before temperature or filters).
"""
from __future__ import annotations

import torch

CANDIDATES = 1024


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, seq_lens: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [S, V]`` float32 → (token ids int32 ``[S]``, their logprobs float32 ``[S]``)."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    threshold = filter_threshold(scaled, top_k, top_p)
    ids = ops.gumbel_argmax(scaled, threshold, seed, seq_lens, greedy)
    logprobs = logits.gather(1, ids[:, None].long())[:, 0] - torch.logsumexp(logits, dim=1)
    return ids, logprobs


def filter_threshold(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest scaled logit each row keeps (``-inf`` keeps all)."""
    n = min(CANDIDATES, scaled.shape[1])
    cand = torch.topk(scaled, n, dim=1).values  # descending
    rank = torch.arange(n, device=scaled.device)[None, :]
    k_on = top_k > 0
    k = torch.where(k_on, top_k.clamp(max=n), n)[:, None]
    in_k = rank < k
    masked = torch.where(in_k, cand, float("-inf"))
    # Top-p renormalises over what top-k kept; without top-k, over the whole row.
    norm = torch.where(k_on, torch.logsumexp(masked, dim=1), torch.logsumexp(scaled, dim=1))
    probs = torch.exp(masked - norm[:, None])
    mass_before = torch.cumsum(probs, dim=1) - probs
    keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0))
    threshold = torch.where(keep, cand, float("inf")).amin(dim=1)
    unclosed = ~k_on & keep[:, -1]
    return torch.where(unclosed, float("-inf"), threshold)
