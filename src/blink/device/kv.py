"""Paged KV page allocator: a stack of free page ids in device memory and one block table per request slot.

The KV pool itself (``[layers, 2, pages, page_size, kv_heads, head_dim]``) belongs to the model; this module only
hands out page ids. ``free_pages[0:top]`` are the free pages, ``top`` lives in ``s.sched[FREE_TOP]``, and
``seq_pages[slot, 0:seq_npages[slot]]`` is the block table of the request in ring slot ``slot``.

Both operations are done by the whole block at once, with the per-sequence work flattened over the threads:

- ``free_sequences``: the pages of ``slots[0:n]`` are pushed in order, sequence ``i``'s page ``j`` landing at
  ``free_pages[top + off_i + j]`` where ``off_i`` is the exclusive prefix of page counts;
- ``allocate_pages``: sequence ``i`` gets ``need[i]`` pages, its ``j``-th new page being
  ``free_pages[top - 1 - (off_i + j)]``; the caller guarantees the stack holds enough.

``KVMirror`` is the same allocator in plain Python, the reference the device code is tested against.
"""
from __future__ import annotations

from blink.device.block import exclusive_scan, locate
from blink.device.numba_compat import cuda
from blink.device.state import FREE_TOP


@cuda.jit(device=True)
def free_sequences(s, slots, n, offsets, partial):
    """Return every page of the sequences in ring slots ``slots[0:n]`` to the free stack."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(tid, n, nt):
        offsets[i] = s.seq_npages[slots[i]]
    cuda.syncthreads()
    total = exclusive_scan(offsets, n, partial)
    top = s.sched[FREE_TOP]
    for index in range(tid, total, nt):
        i = locate(offsets, n, index)
        s.free_pages[top + index] = s.seq_pages[slots[i], index - offsets[i]]
    cuda.syncthreads()
    for i in range(tid, n, nt):
        s.seq_npages[slots[i]] = 0
    if tid == 0:
        s.sched[FREE_TOP] = top + total
    cuda.syncthreads()


@cuda.jit(device=True)
def allocate_pages(s, slots, need, n, partial):
    """Append ``need[i]`` pages to the block table of ring slot ``slots[i]``; ``need`` is consumed (scanned)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    total = exclusive_scan(need, n, partial)
    top = s.sched[FREE_TOP]
    for index in range(tid, total, nt):
        i = locate(need, n, index)
        slot = slots[i]
        s.seq_pages[slot, s.seq_npages[slot] + index - need[i]] = s.free_pages[top - 1 - index]
    cuda.syncthreads()
    for i in range(tid, n, nt):
        end = need[i + 1] if i + 1 < n else total
        s.seq_npages[slots[i]] += end - need[i]
    if tid == 0:
        s.sched[FREE_TOP] = top - total
    cuda.syncthreads()


class KVMirror:
    """The allocator in plain Python, with exactly the device code's page order."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))      # free[0:top], top of stack last
        self.tables: dict[int, list[int]] = {}

    def free_sequences(self, slots: list[int]) -> None:
        for slot in slots:
            self.free.extend(self.tables.pop(slot, []))

    def allocate(self, slots: list[int], need: list[int]) -> None:
        if sum(need) > len(self.free):
            raise ValueError(f"cannot allocate {sum(need)} pages, {len(self.free)} free")
        for slot, count in zip(slots, need):
            taken = [self.free.pop() for _ in range(count)]
            self.tables.setdefault(slot, []).extend(taken)
