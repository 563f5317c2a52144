"""A request's grammar on the scheduler's side (device functions, one thread each): its state moves with each token.

The state is a word offset into the ring's grammars region (``blink.ring.grammar``), kept per request in
``seq_grammar`` (-1: none): set to the start state at admission, handed to the step row that samples for the request
(which masks the logits to the state's tokens), and moved by each token ``consume`` brings in. It depends only on
the tokens the request generated, so a preempted request (its tokens recomputed) and one served from the prefix cache
keep it, and every request in the ring, each choice of an ``n > 1`` request too, has its own.
"""
from __future__ import annotations

from numba import int32

from blink.device.numba_compat import cuda
from blink.ring.grammar import RECORD_WORDS
from blink.ring.layout import FLAG_GRAMMAR


@cuda.jit(device=True)
def fits(s, slot):
    """Whether the header's start state (if it has a grammar) is a state record inside the grammars region."""
    if (s.headers[slot].request_flags & FLAG_GRAMMAR) == 0:
        return True
    start = int32(s.headers[slot].grammar)
    # Subtracted from the region's size, not added to the start: a start near 2**31 must not wrap around.
    return 0 <= start <= s.cfg[0].grammar_words - s.cfg[0].mask_words - RECORD_WORDS


@cuda.jit(device=True)
def start_state(s, slot):
    """The state a newly admitted request starts in (-1: it has no grammar)."""
    header = s.headers[slot]
    return int32(header.grammar) if (header.request_flags & FLAG_GRAMMAR) != 0 else int32(-1)


@cuda.jit(device=True)
def next_state(grammars, state, token, mask_words):
    """The state after ``token`` in ``state``: its pair's, found by binary search of the sorted pairs, or the
    state's default."""
    p = state + mask_words
    lo = 0
    hi = grammars[p + 1]
    while lo < hi:
        mid = (lo + hi) // 2
        t = grammars[p + RECORD_WORDS + 2 * mid]
        if t == token:
            return grammars[p + RECORD_WORDS + 2 * mid + 1]
        if t < token:
            lo = mid + 1
        else:
            hi = mid
    return grammars[p]


@cuda.jit(device=True)
def allows(grammars, state, token):
    """Whether grammar state ``state`` allows ``token`` (its mask's bit)."""
    return ((grammars[state + token // 32] >> (token % 32)) & 1) != 0


@cuda.jit(device=True)
def after_drafts(s, slot, count):
    """The state of ``slot``'s grammar after its first ``count`` drafts (-1: it has no grammar)."""
    state = s.seq_grammar[slot]
    if state >= 0:
        for j in range(count):
            state = next_state(s.grammars, state, s.seq_draft[slot, j], s.cfg[0].mask_words)
    return state


@cuda.jit(device=True)
def allowed_drafts(s, slot, count):
    """How many of ``slot``'s first ``count`` drafts its grammar lets through one after another (all: no grammar);
    a draft it forbids would be rejected anyway, and the row after it would read a state the grammar never
    reaches."""
    state = s.seq_grammar[slot]
    if state < 0:
        return count
    for j in range(count):
        token = s.seq_draft[slot, j]
        if not allows(s.grammars, state, token):
            return j
        state = next_state(s.grammars, state, token, s.cfg[0].mask_words)
    return count


@cuda.jit(device=True)
def advance(s, slot, token):
    """The request in ``slot`` emitted ``token``: its grammar (if any) moves on."""
    state = s.seq_grammar[slot]
    if state >= 0:
        s.seq_grammar[slot] = next_state(s.grammars, state, token, s.cfg[0].mask_words)
