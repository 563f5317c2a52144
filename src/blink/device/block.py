"""Block-wide building blocks for device policy code: prefix scan, binary search over offsets, key-value sort.

Every function here is called by ALL threads of the block (they contain barriers) and works for any block size,
including the handful of threads the CPU simulator runs. Work is spread with stride loops
``for i in range(tid, n, nthreads)`` so one thread per item on the GPU and a few items per thread in the simulator
compute the same result.
"""
from __future__ import annotations

from blink.device.numba_compat import cuda

MAX_THREADS = 1024          # size of the scan scratch: blockDim.x may not exceed it
MIN_CHUNK = 8               # items per thread below which a scan uses fewer threads (and fewer barrier rounds)
WARP = 32                   # threads that run in lockstep: work meant to overlap goes to different warps
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


@cuda.jit(device=True)
def exclusive_scan(values, n, partial):
    """Replace ``values[0:n]`` by its exclusive prefix sum and return the total.

    ``partial`` is scratch of at least ``blockDim.x`` elements of the same dtype (shared memory on the GPU). The
    first ``p`` threads each sum a contiguous chunk of at least MIN_CHUNK items, the ``p`` chunk sums are scanned
    Hillis-Steele style (log2(p) rounds of two barriers), then each chunk is rewritten. Small ``n`` thus costs few
    barriers, which dominate an iteration of the scheduler; ``n == 0`` costs none.
    """
    if n == 0:
        return 0
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    chunk = max((n + nt - 1) // nt, MIN_CHUNK)
    p = (n + chunk - 1) // chunk
    lo = min(tid * chunk, n)
    hi = min(lo + chunk, n)
    own = 0
    for i in range(lo, hi):
        own += values[i]
    if tid < p:
        partial[tid] = own
    cuda.syncthreads()
    offset = 1
    while offset < p:
        add = partial[tid - offset] if tid < p and tid >= offset else 0
        cuda.syncthreads()
        if tid < p:
            partial[tid] += add
        cuda.syncthreads()
        offset *= 2
    running = partial[tid] - own if tid < p else 0
    for i in range(lo, hi):
        v = values[i]
        values[i] = running
        running += v
    total = partial[p - 1]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def locate(offsets, n, index):
    """The largest ``i < n`` with ``offsets[i] <= index``, for non-decreasing ``offsets`` (an exclusive scan).

    Maps a flat work item back to the segment that owns it, so a block can split uneven per-segment work (pages
    of sequences, tokens of rows) evenly over its threads.
    """
    lo = 0
    hi = n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= index:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True)
def sort_pairs(keys, values, count, size):
    """Sort ``(keys[i], values[i])`` for ``i < count`` ascending by key, then value (a bitonic network).

    ``size`` is a power of two >= count and <= len(keys); slots ``count..size-1`` are padded with the largest key
    and the largest value, so that padding sorts after every real pair, even one whose key is the largest int64 (a
    padding value of -1 once sorted before it, and the real request fell out of the waiting queue).
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(count + tid, size, nt):
        keys[i] = INT64_MAX
        values[i] = INT32_MAX
    cuda.syncthreads()
    k = 2
    while k <= size:
        j = k // 2
        while j > 0:
            for i in range(tid, size, nt):
                partner = i ^ j
                if partner > i:
                    a = keys[i]
                    b = keys[partner]
                    out_of_order = a > b or (a == b and values[i] > values[partner])
                    if out_of_order == ((i & k) == 0):
                        keys[i] = b
                        keys[partner] = a
                        v = values[i]
                        values[i] = values[partner]
                        values[partner] = v
            cuda.syncthreads()
            j //= 2
        k *= 2


@cuda.jit(device=True)
def next_power_of_two(n):
    """The smallest power of two >= n (1 for n <= 1): the size ``sort_pairs`` needs for ``n`` pairs."""
    size = 1
    while size < n:
        size *= 2
    return size
