"""Settle's first look at the ring: the three words the agent writes that tell the GPU what moved.

Threads of three warps read ``shutdown`` and the ``submitted`` and ``cancels`` doorbells from the ring's control block,
so the three loads across PCIe cost one round trip: three threads of one warp, each under its own branch, cost three
(the warp runs the branches one after another), and one thread's three loads cost two (ptxas tests the first before
it issues the third). A doorbell that moved since the scheduler last acted on it sets ``COUNT.scan`` /
``COUNT.cancel_bell``. In the resident loop this runs while the step runs (``scheduler.py``), so the PCIe reads are
off the step's path.
"""
from __future__ import annotations

from numba import int64

from blink.device.block import WARP
from blink.device.numba_compat import cuda, load_volatile_field
from blink.device.state import COUNT


@cuda.jit(device=True)
def read_doorbells(s, sh):
    """Three warps read the three words across PCIe at once; the block then agrees on them.

    A doorbell that moved since the scheduler last acted on it (``stats.seen_*``) sets COUNT.scan /
    COUNT.cancel_bell for this settle. What the next prepare acts on is left in ``s.sched[0]``: ``shutdown`` (it
    shuts down) and ``cancel_bell`` (its retire looks at running requests' cancel words).
    """
    tid = cuda.threadIdx.x
    last = cuda.blockDim.x - 1                  # a block of one warp reads them one after another
    if tid == 0 and load_volatile_field(s.control[0], "shutdown") != 0:
        s.sched[0].shutdown = 1
    if tid == min(WARP, last):
        stats = s.stats[0]
        submitted = int64(load_volatile_field(s.control[0], "submitted"))
        if submitted != stats.seen_submitted:
            stats.seen_submitted = submitted
            sh.counters[COUNT.scan] = 1
    if tid == min(2 * WARP, last):
        stats = s.stats[0]
        cancels = int64(load_volatile_field(s.control[0], "cancels"))
        if cancels != stats.seen_cancels:
            stats.seen_cancels = cancels
            sh.counters[COUNT.cancel_bell] = 1
            s.sched[0].cancel_bell = 1
    cuda.syncthreads()
