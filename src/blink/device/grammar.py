"""A request's grammar on the scheduler's side (device functions): its placement mirrored, its state moved on.

A request's header names the first word of its grammar's placement in the ring's grammars region
(``blink.ring.grammar``: a header with the placement's size, id and start state, then the state records). When the
request is collected, the whole block copies the placement into ``grammar_mirror``, the region's copy in device
memory at the same word offsets, unless the mirror already holds it (same size and id): so each placement crosses
PCIe once, and everything after reads device memory. The state is a word offset into the mirror, kept per request
in ``seq_grammar`` (-1: none): set to the start state at admission, handed to the step row that samples for the
request (which masks the logits to the state's tokens), and moved by each token ``consume`` brings in. It depends
only on the tokens the request generated, so a preempted request (its tokens recomputed) and one served from the
prefix cache keep it, and every request in the ring, each choice of an ``n > 1`` request too, has its own.

The agent places a grammar again (under a new id) only over words no request in flight reads, so copying a new
placement never changes what a running request, or a step in flight, reads.
"""
from __future__ import annotations

from numba import int32

from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import COUNT
from blink.ring.grammar import ID_WORD, PLACEMENT_WORDS, RECORD_WORDS, SIZE_WORD, START_WORD
from blink.ring.layout import FLAG_GRAMMAR

COPY_UNROLL = 8
# A mirror holds a placement when the header's words before its start state (size and id) are the ring's.
assert SIZE_WORD < START_WORD and ID_WORD + 2 == START_WORD


@cuda.jit(device=True)
def fits(s, flags, base):
    """Whether the grammar a header names (``request_flags``, ``grammar``: ``flags``, ``base``), if it has one, is a
    placement inside the grammars region whose start state is a state record inside the placement. The region is
    read across PCIe with volatile loads: the agent rewrites it."""
    if (flags & FLAG_GRAMMAR) == 0:
        return True
    words = s.cfg[0].grammar_words
    # Subtracted from the region's size, not added to the start: values near 2**31 must not wrap around.
    if not 0 <= base <= words - PLACEMENT_WORDS:
        return False
    size = load_volatile(s.grammars, base + SIZE_WORD)
    start = load_volatile(s.grammars, base + START_WORD)
    return (PLACEMENT_WORDS <= size <= words - base
            and base + PLACEMENT_WORDS <= start <= base + size - s.cfg[0].mask_words - RECORD_WORDS)


@cuda.jit(device=True)
def start_state(s, flags, base):
    """The state a newly admitted request whose header has ``flags`` and ``base`` starts in (-1: no grammar)."""
    if (flags & FLAG_GRAMMAR) == 0:
        return int32(-1)
    return load_volatile(s.grammars, base + START_WORD)


@cuda.jit(device=True)
def mirror_placement(region, mirror, base):
    """All threads: make ``mirror`` hold the placement that ``region`` (the ring's) has at word ``base``, unless its
    size and id there show it does already. The records go first, each thread issuing COPY_UNROLL loads across PCIe
    before it stores any (a copy is not one round trip per word); the size and id last, after a barrier, so a mirror
    whose size and id match is whole. Every thread decides alike: the words compared change only between barriers."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    held = True
    for w in range(START_WORD):
        held = held and mirror[base + w] == load_volatile(region, base + w)
    if held:
        return
    size = load_volatile(region, base + SIZE_WORD)
    words = cuda.local.array(COPY_UNROLL, int32)
    for first in range(START_WORD, size, nt * COPY_UNROLL):
        for u in range(COPY_UNROLL):            # constant trip count: the loads are issued back to back
            w = first + u * nt + tid
            words[u] = load_volatile(region, base + w) if w < size else int32(0)
        for u in range(COPY_UNROLL):
            w = first + u * nt + tid
            if w < size:
                mirror[base + w] = words[u]
    cuda.syncthreads()
    if tid == 0:
        for w in range(START_WORD):
            mirror[base + w] = load_volatile(region, base + w)
    cuda.syncthreads()


@cuda.jit(device=True)
def mirror(s, sh, n_new):
    """All threads: ``grammar_mirror`` gets the placements that the ``n_new`` new candidates (``sh.slots``, their
    headers loaded) follow, each copied once. Scratch: ``sh.kept``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for j in range(tid, n_new, nt):
        if s.seq_grammar[sh.slots[j]] >= 0:
            sh.kept[cuda.atomic.add(sh.counters, COUNT.grammars, 1)] = sh.slots[j]
    cuda.syncthreads()
    for k in range(sh.counters[COUNT.grammars]):
        mirror_placement(s.grammars, s.grammar_mirror, int32(s.headers[sh.kept[k]].grammar))


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
            state = next_state(s.grammar_mirror, state, s.seq_draft[slot, j], s.cfg[0].mask_words)
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
        if not allows(s.grammar_mirror, state, token):
            return j
        state = next_state(s.grammar_mirror, state, token, s.cfg[0].mask_words)
    return count


@cuda.jit(device=True)
def after(s, state, token):
    """The state after ``token`` of a grammar in ``state`` (-1, no grammar: -1 again)."""
    if state < 0:
        return state
    return next_state(s.grammar_mirror, state, token, s.cfg[0].mask_words)
