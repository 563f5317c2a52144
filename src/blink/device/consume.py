"""Prepare's first phase (device functions, whole block): the previous step's sampled tokens into the ring's output
areas (``emit``: token, logprobs, prefix key, grammar state, stop check), its rows' computed tokens counted, and, for
a sequence that verified drafts (``speculation.py``), the tokens it keeps."""
from __future__ import annotations

from typing import NamedTuple

from numba import int32, int64, uint64

from blink.device import grammar, prefix, sampling
from blink.device.config import MAX_EOS
from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import COUNT, SPEC_ACCEPTED_PER_POS
from blink.ring.layout import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, FLAG_IGNORE_EOS, FLAG_LOGPROBS


class Sequence(NamedTuple):
    """The words of a sequence that ``emit`` reads and moves on, read by ``consume`` all at once when it has the row's
    slot: the tokens it holds (the next one's position), its prompt's length, ``seq_flags``, ``max_tokens``, how many
    stop ids it has, its grammar's state (-1: none) and its prefix-key chain state."""

    total: int
    prompt_len: int
    flags: int
    max_tokens: int
    n_stop: int
    grammar: int
    chain: int


class Emitting(NamedTuple):
    """The configuration's words ``emit`` reads, the same for every row: read once, with the rows' words."""

    n_eos: int
    logprobs: bool          # the ring has a logprobs area
    caching: bool           # prefix caching: sampled tokens extend the chain state
    page: int
    prefix_seed: int


@cuda.jit(device=True)
def stop_reason(s, slot, token, seq, generated, eos, n_eos):
    """Why the request in ``slot`` (its words ``seq``) ends after emitting ``token``, its ``generated``-th token.
    ``eos``: the model's end-of-sequence ids, ``n_eos`` of them used.

    Every EOS slot is compared, used or not (the unused hold 0): a loop of constant length unrolls into
    comparisons of registers, where one that stops at ``n_eos`` branches for each."""
    is_eos = False
    for k in range(MAX_EOS):
        is_eos |= (k < n_eos) & (token == eos[k])
    stop = is_eos & ((seq.flags & FLAG_IGNORE_EOS) == 0)
    for k in range(seq.n_stop):
        stop |= token == s.seq_stop[slot, k]
    if stop:
        return FINISH_STOP
    if generated >= seq.max_tokens:
        return FINISH_LENGTH
    return FINISH_NONE


@cuda.jit(device=True)
def emit(s, r, slot, token, seq, config, eos):
    """The sequence in ``slot``, whose words are ``seq``, takes ``token``, which step row ``r`` sampled: into the
    ring's output area (its logprobs too), its prefix key, grammar state and stop check. Returns (the finish reason,
    FINISH_NONE while it goes on; its words after the token).

    Before its stores it reads only what ``seq`` cannot hold: the row's logprob, the stop ids, the grammar's table
    (``inputs.write_rows`` says why)."""
    n = seq.total - seq.prompt_len
    logprob = load_volatile(s.sampled_logprobs, r)     # stored only where asked for: read before it is known
    reason = stop_reason(s, slot, token, seq, n + 1, eos, config.n_eos)
    state = grammar.after(s, seq.grammar, token)
    chain = seq.chain
    if config.caching:
        chain = prefix.note_token(s, slot, seq.total, token, chain, config.prefix_seed, config.page)
    s.outputs[slot, n] = token
    if config.logprobs and (seq.flags & FLAG_LOGPROBS) != 0:
        s.logprobs[slot, n] = logprob
        sampling.store_top_logprobs(s, r, slot, n)
    s.seq_total[slot] = seq.total + 1
    s.seq_last[slot] = token
    s.seq_grammar[slot] = state
    s.seq_finish[slot] = reason
    return reason, Sequence(int64(seq.total + 1), seq.prompt_len, seq.flags, seq.max_tokens, seq.n_stop,
                            int64(state), chain)


@cuda.jit(device=True)
def consume(s, sh, rows):
    """Bring the previous step's tokens (its ``rows`` rows) into the ring's output areas and decide which sequences
    stop.

    A sequence that verified drafts (``speculation.py``) is taken whole by the thread of its first row: its rows'
    tokens in order while each confirms the draft the next row read; its other rows do nothing.
    The counts that announce the tokens are published by the iteration's settle (``publish``), after one fence.
    Leaves each row's slot in ``sh.slots`` and its tokens computed before the step in ``sh.tokens`` (``prefix``), and
    counts the sequences that stop in ``COUNT.stopped`` (``retire`` looks at the running list only then).
    Two round trips in a row after the one that read ``rows``, not one per word that the next depends on: the
    configuration's words with each row's words and its sampled token (read whether or not the row sampled), then
    its sequence's words (``Sequence``); only then anything stored.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    cfg = s.cfg[0]
    config = Emitting(cfg.n_eos, cfg.logprobs != 0, cfg.prefix_caching != 0, cfg.page_size,
                      uint64(s.stats[0].prefix_seed))
    eos = cuda.local.array(MAX_EOS, int32)
    for k in range(MAX_EOS):
        eos[k] = s.eos_ids[k]
    for r in range(tid, rows, nt):
        draft = s.row_draft[r]
        slot = s.row_slot[r]
        sampled = s.logits_indices[r] >= 0
        query = s.query_start_loc[r + 1] - s.query_start_loc[r]
        # Written by the step's kernels on other SMs; a resident scheduler must not read a stale L1 line.
        token = load_volatile(s.sampled_ids, r)
        done = s.seq_computed[slot]
        drafts = s.seq_ndraft[slot]
        seq = Sequence(int64(s.seq_total[slot]), int64(s.seq_prompt_len[slot]), int64(s.seq_flags[slot]),
                       int64(s.seq_max_tokens[slot]), int64(s.seq_n_stop[slot]), int64(s.seq_grammar[slot]),
                       uint64(s.seq_hash[slot]))
        if draft != 0:
            s.consumed[r] = -1
            continue
        computed = done + query
        emitted = 0
        accepted = 0
        if sampled:
            for j in range(drafts + 1):
                if j > 0:
                    token = load_volatile(s.sampled_ids, r + j)
                emitted += 1
                reason, seq = emit(s, r + j, slot, token, seq, config, eos)
                if reason != FINISH_NONE:
                    cuda.atomic.add(sh.counters, COUNT.stopped, 1)
                    break
                if j == drafts or token != s.seq_draft[slot, j]:
                    break
                computed += 1                     # row j + 1 read this token as its draft: its K/V stand
                cuda.atomic.add(sh.counters, SPEC_ACCEPTED_PER_POS + j, 1)
                accepted += 1
            for j in range(1, drafts + 1):        # the group's other rows complete no page of their own
                sh.slots[r + j] = slot
                sh.tokens[r + j] = computed
        s.consumed[r] = slot if sampled else -1   # n_generated is published after this iteration's fence
        s.seq_computed[slot] = computed
        sh.slots[r] = slot
        sh.tokens[r] = done
        cuda.atomic.add(sh.counters, COUNT.tokens, emitted)
        cuda.atomic.add(sh.counters, COUNT.spec_accepted_tokens, accepted)
        cuda.atomic.add(sh.counters, COUNT.completed, computed // config.page - done // config.page)
        cuda.atomic.add(sh.counters, COUNT.prefill_tokens, max(0, min(computed, seq.prompt_len) - done))
    cuda.syncthreads()
