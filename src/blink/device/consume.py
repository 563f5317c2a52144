"""Prepare's first phase (device functions, whole block): the previous step's sampled tokens into the ring's output
areas (``emit``: token, logprobs, prefix key, grammar state, stop check), its rows' computed tokens counted, and, for
a sequence that verified drafts (``speculation.py``), the tokens it keeps."""
from __future__ import annotations

from blink.device import grammar, prefix, sampling
from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import COUNT, SPEC_ACCEPTED_PER_POS
from blink.ring.layout import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, FLAG_IGNORE_EOS, FLAG_LOGPROBS


@cuda.jit(device=True)
def stop_reason(s, slot, token):
    """Why the request in ``slot`` ends after emitting ``token`` (its ``n``-th token, already counted)."""
    if (s.seq_flags[slot] & FLAG_IGNORE_EOS) == 0:
        for k in range(s.cfg[0].n_eos):
            if token == s.eos_ids[k]:
                return FINISH_STOP
    for k in range(s.seq_n_stop[slot]):
        if token == s.seq_stop[slot, k]:
            return FINISH_STOP
    if s.seq_total[slot] - s.seq_prompt_len[slot] >= s.seq_max_tokens[slot]:
        return FINISH_LENGTH
    return FINISH_NONE


@cuda.jit(device=True)
def emit(s, r, slot, token):
    """The sequence in ``slot`` takes ``token``, which step row ``r`` sampled: into the ring's output area (its
    logprobs too), its prefix key, grammar state and stop check. Returns whether it stops there."""
    n = s.seq_total[slot] - s.seq_prompt_len[slot]
    s.outputs[slot, n] = token
    if s.cfg[0].logprobs != 0 and (s.seq_flags[slot] & FLAG_LOGPROBS) != 0:
        s.logprobs[slot, n] = load_volatile(s.sampled_logprobs, r)
        sampling.store_top_logprobs(s, r, slot, n)
    prefix.note_token(s, slot, s.seq_total[slot], token)
    s.seq_total[slot] += 1
    s.seq_last[slot] = token
    grammar.advance(s, slot, token)
    s.seq_finish[slot] = stop_reason(s, slot, token)
    return s.seq_finish[slot] != FINISH_NONE


@cuda.jit(device=True)
def consume(s, sh):
    """Bring the previous step's tokens into the ring's output areas and decide which sequences stop.

    A sequence that verified drafts (``speculation.py``) is taken whole by the thread of its first row: its rows'
    tokens in order while each confirms the draft the next row read; its other rows do nothing.
    The counts that announce the tokens are published by the iteration's settle (``publish``), after one fence.
    Leaves each row's slot in ``sh.slots`` and its tokens computed before the step in ``sh.tokens`` (``prefix``).
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    for r in range(tid, s.sched[0].rows, nt):
        s.consumed[r] = -1
        if s.row_draft[r] != 0:
            continue
        slot = s.row_slot[r]
        done = s.seq_computed[slot]
        computed = done + s.query_start_loc[r + 1] - s.query_start_loc[r]
        if s.logits_indices[r] >= 0:
            s.consumed[r] = slot                  # n_generated is published after this iteration's fence
            drafts = s.seq_ndraft[slot]
            for j in range(drafts + 1):
                # Written by the step's kernels on other SMs; a resident scheduler must not read a stale L1 line.
                token = load_volatile(s.sampled_ids, r + j)
                cuda.atomic.add(sh.counters, COUNT.tokens, 1)
                if emit(s, r + j, slot, token) or j == drafts or token != s.seq_draft[slot, j]:
                    break
                computed += 1                     # row j + 1 read this token as its draft: its K/V stand
                cuda.atomic.add(sh.counters, COUNT.spec_accepted_tokens, 1)
                cuda.atomic.add(sh.counters, SPEC_ACCEPTED_PER_POS + j, 1)
            for j in range(1, drafts + 1):        # the group's other rows complete no page of their own
                sh.slots[r + j] = slot
                sh.tokens[r + j] = computed
        s.seq_computed[slot] = computed
        sh.slots[r] = slot
        sh.tokens[r] = done
        cuda.atomic.add(sh.counters, COUNT.completed, computed // page - done // page)
        cuda.atomic.add(sh.counters, COUNT.prefill_tokens, max(0, min(computed, s.seq_prompt_len[slot]) - done))
    cuda.syncthreads()
