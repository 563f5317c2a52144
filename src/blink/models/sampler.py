"""In-step sampling: greedy, temperature, min-p, top-k, top-p and per-request seeds, all per row, with fixed shapes.

Everything here has shapes fixed by the bucket, so it captures into the step graph. Filters become one threshold per
row (tokens whose scaled logit is ``>=`` it stay), found among the ``CANDIDATES`` largest logits, in vLLM's order:

- min-p keeps the tokens whose probability (after temperature) is at least ``min_p`` times the largest: a scaled
  logit ``>= floor = max + log(min_p)`` (``-inf`` for ``min_p == 0``), over the whole row;
- ``top_k`` (among the min-p survivors) above ``CANDIDATES`` acts as ``CANDIDATES``;
- top-p keeps the smallest prefix of the (filtered, renormalised) candidates whose mass reaches ``top_p``, as HF's
  warpers do; when even all ``CANDIDATES`` fall short of ``top_p`` (and top-k is off) the row is cut at the floor.

The token is then ``argmax(logit / T + gumbel)`` (Gumbel-max draws exactly from the softmax), with the noise a hash of
``(seed, seq_len, token)``. The logprobs written (the sampled token's, and the ``top`` most likely tokens') are of
the distribution the logits give (after ``logit_bias`` and the penalties, which the step applies to them first, and
before temperature or filters). The scaled logits ``logit / T`` are never stored: the kernels divide as they read
(``ops.sampling_params`` gives each row's divisor, ``T`` or 1 for a greedy row, and its min-p floor,
``ops.row_logsumexp`` both rows' log-sum-exps in one pass, ``ops.candidate_threshold`` applies the filters to the top
logits, scaled, since dividing by a positive ``T`` keeps their order, ``ops.gumbel_argmax`` picks the token, and
``ops.store_sampled`` writes the sampled rows' results into the step's buffers).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

CANDIDATES = 1024


class Sampled(NamedTuple):
    """Per row: the token (int32), its logprob, and the ``top`` most likely tokens (int32) and their logprobs,
    most likely first (all float32)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, seq_lens: torch.Tensor, ops, out: Sampled,
           logits_indices: torch.Tensor) -> None:
    """``logits [S, V]`` (the model's dtype: the kernels read it as it is and compute in float32) → in place on
    ``out`` (``[S]`` and ``[S, top]`` buffers) for the rows with ``logits_indices >= 0``; the others keep theirs."""
    # Converting to float32 is exact and keeps the order, so the top of the model-dtype row is the same set of values
    # (half the bytes to search in bf16). Rows that read no candidates get -inf ones: a floor and threshold of -inf.
    values, indices = ops.top_candidates(logits, min(CANDIDATES, logits.shape[1]), logits_indices, top_k, top_p, min_p,
                                         out.top_ids.shape[1])
    greedy, divisor, floor = ops.sampling_params(temperature, min_p, values)
    lse, lse_scaled = ops.row_logsumexp(logits, divisor, floor)
    threshold = ops.candidate_threshold(values, divisor, lse_scaled, top_k, top_p, floor)
    ids = ops.gumbel_argmax(logits, divisor, threshold, seed, seq_lens, greedy)
    ops.store_sampled(out, logits_indices, logits, ids, lse, values, indices)
