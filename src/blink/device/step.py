"""Step inputs: the static device buffers through which the scheduler tells a captured model step what to do.

The batcher (on the GPU, or under the simulator) writes these buffers between steps; the model step graph (captured
once per token bucket) only ever reads them, so nothing in a step depends on host values. Every buffer is allocated
once at its maximum size; a graph captured for bucket ``T`` reads the first ``T`` token rows and the first
``StepLayout.sample_rows(T)`` sequence rows.

Invariants the batcher guarantees (and the model may rely on):

- Sequences occupy rows ``0..num_seqs-1``; their query tokens are packed in row order:
  sequence ``i`` owns token rows ``query_start_loc[i] .. query_start_loc[i+1]-1``.
  ``query_start_loc`` is non-decreasing; rows ``>= num_seqs`` are empty (``query_start_loc`` repeats its last value,
  ``seq_lens`` is 0) and token rows ``>= query_start_loc[num_seqs]`` are padding (``slot_mapping == -1``).
- ``seq_lens[i]`` is sequence ``i``'s context length *after* this step (cached prefix + this step's query tokens);
  ``positions`` of its query tokens are ``seq_lens[i] - q_len .. seq_lens[i] - 1``.
- ``block_tables[i, j]`` is the KV page holding positions ``j*page_size .. (j+1)*page_size-1`` of sequence ``i``,
  valid for ``j < ceil(seq_lens[i] / page_size)``; ``slot_mapping[t] = page * page_size + offset`` is where token
  ``t``'s new K/V go in the pool ``[layers, 2, pages, page_size, kv_heads, head_dim]``. Rows may share pages (a
  cached prefix): a shared page is full and computed before the step, and no token of the step writes into a page
  that another row's block table holds or that the step reads.
- Attention reads its own view of the rows, ``attn_query_start_loc`` and ``attn_seq_lens``, equal to
  ``query_start_loc`` and ``seq_lens`` but where rows ``i .. i + k`` are one sequence's last token and its ``k``
  speculative drafts, one token each (``device/speculation.py``): there row ``i`` attends as one chunk of all ``k + 1``
  tokens (``attn_seq_lens[i] = seq_lens[i + k]``, its block table valid that far) and rows ``i + 1 .. i + k`` are
  empty (their start is the chunk's end, their length 0). Each token sees the same keys either way (its own position
  and before); as a chunk the sequence's K/V are read once instead of ``k + 1`` times.
- ``logits_indices[i]`` is the token row whose logits sequence ``i`` samples from (its last query token), or -1 when
  the row samples nothing this step (an empty row, or a prefill chunk that does not reach the end of the prompt).
- Sampling parameters are per sequence row. ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1``
  disable those filters. The random stream of row ``i`` depends only on ``(seed[i], seq_lens[i])``, so a seeded
  request samples the same tokens whatever else is in the batch. ``penalties[i]`` are the row's presence,
  frequency and repetition penalties (0, 0, 1: none) and ``prompt_lens[i]`` its prompt length: the penalties read the
  row's history, positions ``0 .. seq_lens[i] - 1`` through its block table, those below ``prompt_lens[i]`` being
  prompt tokens. ``logit_bias[i, j]`` is added to the logit of token ``logit_bias_ids[i, j]`` for ``j <
  n_logit_bias[i]`` (entries past it are stale); ``min_p[i]`` (0: off) is the row's min-p filter.
  ``grammar_state[i]`` (-1: none) is the state of the row's grammar, a word offset into the ring's grammars region
  (``blink.ring.grammar``): the step allows only that state's tokens, after the penalties.

The step writes ``sampled_ids[i]`` and ``sampled_logprobs[i]`` for every row with ``logits_indices[i] >= 0``, and
``sampled_top_ids[i]`` / ``sampled_top_logprobs[i]``: the ``max_top_logprobs`` most likely tokens, most likely first.
It records every query token at its KV slot in the token history, ``history_tokens[slot_mapping[t]] =
token_ids[t]`` (``blink.models.history``; padding dropped): its penalties read it, and so does the scheduler's draft
lookup (``speculation.token_at``). A step that recorded nothing would get wrong drafts, which verification rejects:
never a wrong token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.ring.geometry import MAX_SPECULATIVE_TOKENS, RingGeometry

N_PENALTIES = 3     # presence, frequency, repetition: one f32 each per row


@dataclass(frozen=True)
class StepLayout:
    """Sizes of the step buffers. ``max_num_batched_tokens`` is the largest token bucket that is captured;
    ``max_logit_bias`` and ``max_top_logprobs`` are the ring's (``RingGeometry``). ``decode_query_len`` is the most
    query tokens a decoding sequence brings to a step: 1, or 1 + the drafts it verifies when the engine speculates
    (attention then takes query blocks that hold a verifying sequence's tokens together: ``attention.tiles_for``)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_pages_per_seq: int = 512
    max_logit_bias: int = RingGeometry.max_logit_bias
    max_top_logprobs: int = RingGeometry.max_top_logprobs
    decode_query_len: int = 1

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_pages_per_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StepLayout.{name} must be a positive int (got {value!r})")
        if not isinstance(self.decode_query_len, int) or not 1 <= self.decode_query_len <= 1 + MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"StepLayout.decode_query_len must be an int in [1, {1 + MAX_SPECULATIVE_TOKENS}] (a "
                             f"token and at most MAX_SPECULATIVE_TOKENS drafts; got {self.decode_query_len!r})")
        for name in ("max_logit_bias", "max_top_logprobs"):
            RingGeometry.check(name, getattr(self, name), "StepLayout")

    def sample_rows(self, bucket_tokens: int) -> int:
        """Sequence rows a step of ``bucket_tokens`` tokens can hold: one sequence needs at least one token."""
        return min(bucket_tokens, self.max_num_seqs)

    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Name -> (shape, dtype) of every buffer, in the order they are allocated."""
        t, s, p = self.max_num_batched_tokens, self.max_num_seqs, self.max_pages_per_seq
        b, k = self.max_logit_bias, self.max_top_logprobs
        i32, i64, f32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
        return {
            "num_seqs": ((1,), i32),
            "token_ids": ((t,), i32),
            "positions": ((t,), i32),
            "slot_mapping": ((t,), i64),
            "query_start_loc": ((s + 1,), i32),
            "seq_lens": ((s,), i32),
            "attn_query_start_loc": ((s + 1,), i32),
            "attn_seq_lens": ((s,), i32),
            "block_tables": ((s, p), i32),
            "logits_indices": ((s,), i32),
            "temperature": ((s,), f32),
            "top_p": ((s,), f32),
            "top_k": ((s,), i32),
            "seed": ((s,), i64),
            "prompt_lens": ((s,), i32),
            "penalties": ((s, N_PENALTIES), f32),
            "min_p": ((s,), f32),
            "n_logit_bias": ((s,), i32),
            "logit_bias_ids": ((s, b), i32),
            "logit_bias": ((s, b), f32),
            "grammar_state": ((s,), i32),
            "sampled_ids": ((s,), i32),
            "sampled_logprobs": ((s,), f32),
            "sampled_top_ids": ((s, k), i32),
            "sampled_top_logprobs": ((s, k), f32),
        }


class StepBuffers:
    """The step buffers as torch tensors on one device (attributes named as in ``StepLayout.fields``)."""

    def __init__(self, layout: StepLayout, device="cpu"):
        import torch

        self.layout = layout
        for name, (shape, dtype) in layout.fields().items():
            setattr(self, name, torch.zeros(shape, dtype=getattr(torch, dtype.name), device=device))
        self.slot_mapping.fill_(-1)
        self.logits_indices.fill_(-1)
        self.top_p.fill_(1.0)
        self.grammar_state.fill_(-1)
        self.penalties[:, N_PENALTIES - 1] = 1.0      # repetition 1: no penalties until a row is planned

    def tensors(self) -> dict:
        """Name -> tensor, in ``StepLayout.fields`` order."""
        return {name: getattr(self, name) for name in self.layout.fields()}
