"""Settle's first look at the ring: the three words the agent writes that tell the GPU what moved.

Threads of three warps read ``shutdown`` and the ``submitted`` and ``cancels`` doorbells from the ring's control block,
so the three loads across PCIe cost one round trip: three threads of one warp, each under its own branch, cost three
(the warp runs the branches one after another), and one thread's three loads cost two (ptxas tests the first before
it issues the third). A doorbell that moved since the scheduler last acted on it sets ``COUNT.scan`` /
``COUNT.cancel_bell``. In the resident loop this runs while the step runs (``scheduler.py``), the loads issued before
publish's fence, so one round trip covers both. An idle resident loop watches them (``moved``) without acting on them
until one moves, one round trip a look.
"""
from __future__ import annotations

from numba import int64

from blink.device.block import WARP
from blink.device.numba_compat import cuda, load_volatile_field
from blink.device.state import COUNT


@cuda.jit(device=True)
def load_doorbells(s):
    """Issue the three loads across PCIe, each from a thread of its own warp (thread 0: ``shutdown``; ``WARP``:
    ``submitted``; ``2 × WARP``: ``cancels``). Returns (shutdown, submitted, cancels): each word is its reader's,
    zero in every other thread. Nothing waits for a load until its word is used (``note_doorbells``), so work placed
    between the two (the resident loop's publish, whose fence waits for them too) hides the round trip."""
    tid = cuda.threadIdx.x
    last = cuda.blockDim.x - 1                  # a block of one warp reads them one after another
    shutdown = 0
    submitted = int64(0)
    cancels = int64(0)
    if tid == 0:
        shutdown = load_volatile_field(s.control[0], "shutdown")
    if tid == min(WARP, last):
        submitted = int64(load_volatile_field(s.control[0], "submitted"))
    if tid == min(2 * WARP, last):
        cancels = int64(load_volatile_field(s.control[0], "cancels"))
    return shutdown, submitted, cancels


@cuda.jit(device=True)
def note_doorbells(s, sh, shutdown, submitted, cancels):
    """What ``load_doorbells`` read, acted on by its readers; the block then agrees on it.

    A doorbell that moved since the scheduler last acted on it (``stats.seen_*``) sets COUNT.scan /
    COUNT.cancel_bell for this settle. What the next prepare acts on is left in ``s.sched[0]``: ``shutdown`` (it
    shuts down) and ``cancel_bell`` (its retire looks at running requests' cancel words).
    """
    tid = cuda.threadIdx.x
    last = cuda.blockDim.x - 1
    if tid == 0 and shutdown != 0:
        s.sched[0].shutdown = 1
    if tid == min(WARP, last):
        stats = s.stats[0]
        if submitted != stats.seen_submitted:
            stats.seen_submitted = submitted
            sh.counters[COUNT.scan] = 1
    if tid == min(2 * WARP, last):
        stats = s.stats[0]
        if cancels != stats.seen_cancels:
            stats.seen_cancels = cancels
            sh.counters[COUNT.cancel_bell] = 1
            s.sched[0].cancel_bell = 1
    cuda.syncthreads()


@cuda.jit(device=True)
def moved(s, sh, bells):
    """Whether what ``load_doorbells`` read (``bells``) asks for a collect: a shutdown, or a doorbell that moved since
    the scheduler last acted on it. Writes nothing but the part's scratch (``COUNT.scan``), so the next settle still
    sees the move and acts on it; the block agrees on the answer."""
    shutdown, submitted, cancels = bells
    tid = cuda.threadIdx.x
    last = cuda.blockDim.x - 1
    if tid == 0 and shutdown != 0:
        sh.counters[COUNT.scan] = 1
    if tid == min(WARP, last) and submitted != s.stats[0].seen_submitted:
        sh.counters[COUNT.scan] = 1
    if tid == min(2 * WARP, last) and cancels != s.stats[0].seen_cancels:
        sh.counters[COUNT.scan] = 1
    cuda.syncthreads()
    return sh.counters[COUNT.scan] != 0
