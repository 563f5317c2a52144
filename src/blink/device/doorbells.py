"""The iteration's first phase: the three words the agent writes that tell the GPU what moved.

Thread 0-2 read ``shutdown`` and the ``submitted`` and ``cancels`` doorbells from the ring's control block (three words
across PCIe, in parallel), or take the copies the resident loop read while the last step ran; the block agrees on
them, and a doorbell that moved since the scheduler last acted on it sets ``K_SCAN`` / ``K_CANCEL_BELL``.
"""
from __future__ import annotations

from numba import int64

from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import (C32_SHUTDOWN, C64_CANCELS, C64_SUBMITTED, DB_CANCELS, DB_SHUTDOWN, DB_SUBMITTED,
                                DB_VALID, K_CANCEL_BELL, K_SCAN, K_SHUTDOWN, S_SEEN_CANCELS, S_SEEN_SUBMITTED)


@cuda.jit(device=True)
def read_doorbells(s, sh):
    """Three threads read shutdown and the two doorbells across PCIe at once; the block then agrees on them.

    A doorbell that moved since the scheduler last acted on it sets K_SCAN / K_CANCEL_BELL for this iteration. The
    fire-and-forget loop reads the three words while the previous step runs and leaves them in ``s.doorbells``
    (``DB_*``); then no PCIe read is on this iteration's path.
    """
    tid = cuda.threadIdx.x
    prefetched = s.doorbells[DB_VALID] != 0   # the resident loop read them while the last step ran (shim.cu)
    cuda.syncthreads()
    if prefetched:
        if tid == 0:
            s.doorbells[DB_VALID] = 0
            sh.counters[K_SHUTDOWN] = s.doorbells[DB_SHUTDOWN]
            if s.doorbells[DB_SUBMITTED] != s.stats[S_SEEN_SUBMITTED]:
                s.stats[S_SEEN_SUBMITTED] = s.doorbells[DB_SUBMITTED]
                sh.counters[K_SCAN] = 1
            if s.doorbells[DB_CANCELS] != s.stats[S_SEEN_CANCELS]:
                s.stats[S_SEEN_CANCELS] = s.doorbells[DB_CANCELS]
                sh.counters[K_CANCEL_BELL] = 1
        cuda.syncthreads()
        return
    if tid == 0:
        sh.counters[K_SHUTDOWN] = load_volatile(s.ctl32, C32_SHUTDOWN)
    if tid == min(1, cuda.blockDim.x - 1):
        submitted = int64(load_volatile(s.ctl64, C64_SUBMITTED))
        if submitted != s.stats[S_SEEN_SUBMITTED]:
            s.stats[S_SEEN_SUBMITTED] = submitted
            sh.counters[K_SCAN] = 1
    if tid == min(2, cuda.blockDim.x - 1):
        cancels = int64(load_volatile(s.ctl64, C64_CANCELS))
        if cancels != s.stats[S_SEEN_CANCELS]:
            s.stats[S_SEEN_CANCELS] = cancels
            sh.counters[K_CANCEL_BELL] = 1
    cuda.syncthreads()
