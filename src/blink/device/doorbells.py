"""The iteration's first phase: the three words the agent writes that tell the GPU what moved.

Thread 0-2 read ``shutdown`` and the ``submitted`` and ``cancels`` doorbells from the ring's control block (three words
across PCIe, in parallel), or take the copies the resident loop read while the last step ran; the block agrees on
them, and a doorbell that moved since the scheduler last acted on it sets ``COUNT.scan`` / ``COUNT.cancel_bell``.
"""
from __future__ import annotations

from numba import int64

from blink.device.numba_compat import cuda, load_volatile_field
from blink.device.state import COUNT


@cuda.jit(device=True)
def read_doorbells(s, sh):
    """Three threads read shutdown and the two doorbells across PCIe at once; the block then agrees on them.

    A doorbell that moved since the scheduler last acted on it (``stats.seen_*``) sets COUNT.scan /
    COUNT.cancel_bell for this iteration. The fire-and-forget loop reads the three words while the previous step runs
    and leaves them in ``s.doorbells``; then no PCIe read is on this iteration's path.
    """
    tid = cuda.threadIdx.x
    bells = s.doorbells[0]
    stats = s.stats[0]
    prefetched = bells.valid != 0   # the resident loop read them while the last step ran (shim.cu)
    cuda.syncthreads()
    if prefetched:
        if tid == 0:
            bells.valid = 0
            sh.counters[COUNT.shutdown] = bells.shutdown
            if bells.submitted != stats.seen_submitted:
                stats.seen_submitted = bells.submitted
                sh.counters[COUNT.scan] = 1
            if bells.cancels != stats.seen_cancels:
                stats.seen_cancels = bells.cancels
                sh.counters[COUNT.cancel_bell] = 1
        cuda.syncthreads()
        return
    if tid == 0:
        sh.counters[COUNT.shutdown] = load_volatile_field(s.control[0], "shutdown")
    if tid == min(1, cuda.blockDim.x - 1):
        submitted = int64(load_volatile_field(s.control[0], "submitted"))
        if submitted != stats.seen_submitted:
            stats.seen_submitted = submitted
            sh.counters[COUNT.scan] = 1
    if tid == min(2, cuda.blockDim.x - 1):
        cancels = int64(load_volatile_field(s.control[0], "cancels"))
        if cancels != stats.seen_cancels:
            stats.seen_cancels = cancels
            sh.counters[COUNT.cancel_bell] = 1
    cuda.syncthreads()
