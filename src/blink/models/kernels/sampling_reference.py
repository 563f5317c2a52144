"""Torch references of the sampler's kernels (``sampling.py``), part of ``reference``'s ops: the specification the
Triton kernels are tested against, and the CPU path. ``S`` rows of ``V`` logits each."""
from __future__ import annotations

import torch

from ..hashing import gumbel_noise, row_key


def top_candidates(logits: torch.Tensor, n: int, logits_indices: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``n`` largest logits (its dtype) and their ids (int64), descending, in the rows that read them: a
    row that samples (``logits_indices >= 0``) and filters (``top_k > 0``, ``top_p < 1`` or ``min_p > 0``), or every
    row that samples when the step writes ``top > 0`` top logprobs; ``-inf`` and id 0 in the others. Among equal
    logits the order of ids is unspecified (``torch.topk``'s)."""
    cand = torch.topk(logits, n, dim=1)
    needs = (logits_indices >= 0) & ((top_k > 0) | (top_p < 1) | (min_p > 0) | (top > 0))
    return (torch.where(needs[:, None], cand.values, float("-inf")).to(logits.dtype),
            torch.where(needs[:, None], cand.indices, 0))


def sampling_params(temperature: torch.Tensor, min_p: torch.Tensor,
                    cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, from its ``temperature``, ``min_p`` and largest logit (``cand [S, n]``'s first column): ``greedy``
    (temperature ``<= 0``), the ``divisor`` its logits are scaled by (its temperature, 1 for a greedy row) and min-p's
    ``floor`` on the scaled logits, ``max / divisor + log(min_p)`` (``-inf`` for ``min_p == 0``), float32."""
    greedy = temperature <= 0
    divisor = torch.where(greedy, 1.0, temperature)
    return greedy, divisor, cand[:, 0].float() / divisor + torch.log(min_p)


def row_logsumexp(logits: torch.Tensor, divisor: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Per row of ``logits [S, V]`` (any float dtype, computed in float32): (log-sum-exp of the row, log-sum-exp of
    the entries of the row divided by ``divisor`` that are ``>= floor``, the min-p survivors)."""
    logits = logits.float()
    scaled = logits / divisor[:, None]
    return torch.logsumexp(logits, dim=1), torch.logsumexp(torch.where(scaled >= floor[:, None], scaled,
                                                                       float("-inf")), dim=1)


def candidate_threshold(cand: torch.Tensor, divisor: torch.Tensor, lse_scaled: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The filters of ``blink.models.sampler`` on each row's ``n`` largest logits ``cand [S, n]`` (descending):
    the smallest of them, divided by ``divisor`` (> 0, which keeps the order), that min-p (a scaled logit
    ``>= floor``), then top-k among those, then top-p keep; ``floor`` where top-p (top-k off) is still short of
    ``top_p`` after all ``n``. ``lse_scaled`` is the log-sum-exp of the min-p survivors of each whole scaled row:
    top-p renormalises over it without top-k, over the top-k survivors with it."""
    n = cand.shape[1]
    cand = cand.float() / divisor[:, None]
    rank = torch.arange(n, device=cand.device)[None, :]
    k_on = top_k > 0
    k = torch.where(k_on, top_k.clamp(max=n), n)[:, None]
    in_k = (rank < k) & (cand >= floor[:, None])
    masked = torch.where(in_k, cand, float("-inf"))
    norm = torch.where(k_on, torch.logsumexp(masked, dim=1), lse_scaled)
    probs = torch.exp(masked - norm[:, None])
    mass_before = torch.cumsum(probs, dim=1) - probs
    # top_p >= 1 is off: the running mass can round to 1 before the last candidate.
    keep = in_k & ((top_p[:, None] >= 1) | (mass_before < top_p[:, None]) | (rank == 0))
    threshold = torch.where(keep, cand, float("inf")).amin(dim=1)
    unclosed = ~k_on & keep[:, -1]
    return torch.where(unclosed, floor, threshold)


def gumbel_argmax(logits: torch.Tensor, divisor: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
                  seq_lens: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Per row, with ``scaled = logits / divisor``: ``argmax(scaled)`` where ``greedy``, else
    ``argmax(scaled + gumbel(key, index))`` over the entries ``>= threshold``, with ``key = row_key(seed, seq_len)``.
    Ties go to the lowest index. Returns int32 token ids ``[S]``."""
    scaled = logits.float() / divisor[:, None]
    key = row_key(seed, seq_lens)
    vocab = torch.arange(scaled.shape[1], device=scaled.device)
    noisy = torch.where(scaled >= threshold[:, None], scaled + gumbel_noise(key[:, None], vocab[None, :]),
                        float("-inf"))
    return torch.where(greedy[:, None], scaled, noisy).argmax(dim=1).to(torch.int32)


def store_sampled(out, logits_indices: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor,
                  cand_values: torch.Tensor, cand_indices: torch.Tensor) -> None:
    """In place on ``out`` (a ``sampler.Sampled`` of ``[S]`` / ``[S, top]`` buffers), for the rows with
    ``logits_indices >= 0`` (the others keep their values): the token ``ids``, its logprob ``logits[row, id] - lse``
    and the ``top`` candidates (``cand_values`` / ``cand_indices``, most likely first) as int32 ids and logprobs."""
    top = out.top_ids.shape[1]
    valid = logits_indices >= 0
    logprobs = logits.gather(1, ids[:, None].long())[:, 0].float() - lse
    out.ids.copy_(torch.where(valid, ids, out.ids))
    out.logprobs.copy_(torch.where(valid, logprobs, out.logprobs))
    out.top_ids.copy_(torch.where(valid[:, None], cand_indices[:, :top].int(), out.top_ids))
    out.top_logprobs.copy_(torch.where(valid[:, None], cand_values[:, :top].float() - lse[:, None], out.top_logprobs))
