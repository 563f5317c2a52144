"""Prepare's first phase (device functions, whole block): the previous step's sampled tokens into the ring's output
areas (``emit``: token, logprobs, prefix key, grammar state, stop check), its rows' computed tokens counted, and, for
a sequence that verified drafts (``speculation.py``), the tokens it keeps."""
from __future__ import annotations

from blink.device import grammar, prefix, sampling
from blink.device.config import MAX_EOS
from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import COUNT, SPEC_ACCEPTED_PER_POS
from blink.ring.layout import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, FLAG_IGNORE_EOS, FLAG_LOGPROBS


@cuda.jit(device=True)
def stop_reason(s, slot, token, flags, generated, max_tokens):
    """Why the request in ``slot`` (``seq_flags`` ``flags``, ``max_tokens``) ends after emitting ``token``, its
    ``generated``-th token.

    Every EOS slot is compared, used or not (the unused hold 0): a loop of constant length unrolls into loads that
    are in flight together, where one that stops at ``n_eos`` waits for each before it issues the next."""
    n_eos = s.cfg[0].n_eos
    n_stop = s.seq_n_stop[slot]
    eos = False
    for k in range(MAX_EOS):
        eos |= (k < n_eos) & (token == s.eos_ids[k])
    stop = eos & ((flags & FLAG_IGNORE_EOS) == 0)
    for k in range(n_stop):
        stop |= token == s.seq_stop[slot, k]
    if stop:
        return FINISH_STOP
    if generated >= max_tokens:
        return FINISH_LENGTH
    return FINISH_NONE


@cuda.jit(device=True)
def emit(s, r, slot, token):
    """The sequence in ``slot`` takes ``token``, which step row ``r`` sampled: into the ring's output area (its
    logprobs too), its prefix key, grammar state and stop check. Returns whether it stops there.

    Everything is read and decided before anything is stored (``inputs.write_rows`` says why)."""
    total = s.seq_total[slot]
    n = total - s.seq_prompt_len[slot]
    flags = s.seq_flags[slot]
    logprobs = (s.cfg[0].logprobs != 0) & ((flags & FLAG_LOGPROBS) != 0)
    reason = stop_reason(s, slot, token, flags, n + 1, s.seq_max_tokens[slot])
    state = grammar.after(s, slot, token)
    prefix.note_token(s, slot, total, token)
    s.outputs[slot, n] = token
    if logprobs:
        s.logprobs[slot, n] = load_volatile(s.sampled_logprobs, r)
        sampling.store_top_logprobs(s, r, slot, n)
    s.seq_total[slot] = total + 1
    s.seq_last[slot] = token
    s.seq_grammar[slot] = state
    s.seq_finish[slot] = reason
    return reason != FINISH_NONE


@cuda.jit(device=True)
def consume(s, sh):
    """Bring the previous step's tokens into the ring's output areas and decide which sequences stop.

    A sequence that verified drafts (``speculation.py``) is taken whole by the thread of its first row: its rows'
    tokens in order while each confirms the draft the next row read; its other rows do nothing.
    The counts that announce the tokens are published by the iteration's settle (``publish``), after one fence.
    Leaves each row's slot in ``sh.slots`` and its tokens computed before the step in ``sh.tokens`` (``prefix``), and
    counts the sequences that stop in ``COUNT.stopped`` (``retire`` looks at the running list only then).
    A row's words are read before any is stored, as in ``emit``.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    for r in range(tid, s.sched[0].rows, nt):
        draft = s.row_draft[r]
        slot = s.row_slot[r]
        sampled = s.logits_indices[r] >= 0
        query = s.query_start_loc[r + 1] - s.query_start_loc[r]
        if draft != 0:
            s.consumed[r] = -1
            continue
        done = s.seq_computed[slot]
        drafts = s.seq_ndraft[slot]
        prompt_len = s.seq_prompt_len[slot]
        computed = done + query
        emitted = 0
        accepted = 0
        if sampled:
            for j in range(drafts + 1):
                # Written by the step's kernels on other SMs; a resident scheduler must not read a stale L1 line.
                token = load_volatile(s.sampled_ids, r + j)
                emitted += 1
                if emit(s, r + j, slot, token):
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
        cuda.atomic.add(sh.counters, COUNT.completed, computed // page - done // page)
        cuda.atomic.add(sh.counters, COUNT.prefill_tokens, max(0, min(computed, prompt_len) - done))
    cuda.syncthreads()
