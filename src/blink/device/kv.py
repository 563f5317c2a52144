"""Paged KV pages: reference counts, the free stack, the LRU of evictable cached pages, one block table per slot.

The KV pool itself (``[layers, 2, pages, page_size, kv_heads, head_dim]``) belongs to the model; this module only
hands out page ids. ``seq_pages[slot, 0:seq_npages[slot]]`` is the block table of the request in ring slot ``slot``.
Every page is in exactly one of three states:

- **held**: ``page_ref[p]`` block tables hold it (more than one only for a cached prefix page, which nobody writes);
- **free**: on the free stack ``free_pages[0:free_top]``, uncached;
- **evictable**: cached (in the hash table, ``table.py``) and held by nobody; its live entry in the LRU ring is
  ``lru_pages[page_lru[p]]``. Allocation may take ``free_top + evictable`` pages (``free_total``; both in
  ``s.sched[0]``).

The LRU ring ``lru_pages`` (2 x num_pages entries) lists released cached pages oldest first, from ``lru_head``. An
entry is live iff ``page_lru[its page] == its index``: a page taken back by a prefix hit (``hold``) or evicted leaves
a stale entry, skipped when the head passes it and dropped by ``compact_lru`` when the ring would overflow.

Block-wide operations, the per-page work flattened over the threads:

- ``free_sequences``: drop the references of ``slots[0:n]``; a page whose last reference goes is released, cached
  ones to the LRU's tail, others onto the stack, in flat order over the sequences, each from its LAST page, so that
  a prefix's first pages are evicted last;
- ``allocate_pages``: sequence ``i`` gets ``need[i]`` pages from the top of the stack, after ``evict`` moved the
  oldest evictable pages onto it if the stack held too few; the caller guarantees ``free_total`` pages suffice.

``blink.device.mirror.KVMirror`` is the same in plain Python, the reference the device code is tested against.
"""
from __future__ import annotations

from blink.device.block import exclusive_scan, locate
from blink.device.numba_compat import cuda
from blink.device.state import COUNT, MAX_CANDIDATES, SCRATCH_CLEAR
from blink.device.table import forget


@cuda.jit(device=True)
def free_total(s):
    """Pages an allocation may take: the free stack and the evictable cached pages."""
    return s.sched[0].free_top + s.sched[0].evictable


@cuda.jit(device=True)
def pages_for(tokens, page_size):
    return (tokens + page_size - 1) // page_size


@cuda.jit(device=True)
def pages_short(s, slot, tokens):
    """Pages the block table of ``slot`` lacks for the K/V of the sequence's first ``tokens`` tokens; never negative:
    a sequence may hold pages past them (a decode, those its rejected drafts were written to), and those are not
    free for anyone else. The held pages are read before the division, whose branches (a 64-bit divide) would keep
    the load a round trip behind the word ``tokens`` came from."""
    held = s.seq_npages[slot]
    return max(0, pages_for(tokens, s.cfg[0].page_size) - held)


@cuda.jit(device=True)
def hold(s, sh, page):
    """One more block table holds ``page``; an evictable page leaves the LRU (its entry goes stale). The caller
    subtracts ``COUNT.unevicted`` from ``evictable`` after a barrier."""
    if cuda.atomic.add(s.page_ref, page, 1) == 0:
        s.page_lru[page] = -1
        cuda.atomic.add(sh.counters, COUNT.unevicted, 1)


@cuda.jit(device=True)
def page_of(s, slots, offsets, n, index):
    """Flat item ``index`` over the block tables of ``slots[0:n]`` (``offsets``: their page counts, scanned), each
    table walked from its last page back."""
    i = locate(offsets, n, index)
    slot = slots[i]
    return s.seq_pages[slot, s.seq_npages[slot] - 1 - (index - offsets[i])]


@cuda.jit(device=True)
def free_sequences(s, sh, slots, n):
    """Drop the block tables of the sequences in ring slots ``slots[0:n]`` and release the pages nobody holds now.

    A page held twice in this batch is released by its first item (flat order), whichever thread drops the last
    reference: each item claims its page with an atomic min over ``page_scratch``. Scratch: ``sh.pages`` (page
    counts, scanned), ``sh.rank``, ``sh.tokens`` and ``sh.chunk``.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(tid, n, nt):
        sh.pages[i] = s.seq_npages[slots[i]]
    cuda.syncthreads()
    total = exclusive_scan(sh.pages, n, sh.partial)
    if s.sched[0].lru_count + total > s.lru_pages.shape[0]:
        compact_lru(s, sh)
    for index in range(tid, total, nt):
        page = page_of(s, slots, sh.pages, n, index)
        cuda.atomic.sub(s.page_ref, page, 1)
        cuda.atomic.min(s.page_scratch, page, index)
    cuda.syncthreads()
    for first in range(0, total, MAX_CANDIDATES):
        release(s, sh, slots, n, first, min(MAX_CANDIDATES, total - first))
    for index in range(tid, total, nt):
        s.page_scratch[page_of(s, slots, sh.pages, n, index)] = SCRATCH_CLEAR
    cuda.syncthreads()
    for i in range(tid, n, nt):
        s.seq_npages[slots[i]] = 0
    cuda.syncthreads()


@cuda.jit(device=True)
def released(s, page, index):
    """Whether item ``index`` releases ``page`` (nobody holds it any more, and the item claimed it)."""
    return s.page_ref[page] == 0 and s.page_scratch[page] == index


@cuda.jit(device=True)
def release(s, sh, slots, n, first, count):
    """``free_sequences``' items ``first .. first + count - 1`` (count <= MAX_CANDIDATES): released pages onto the
    stack (``sh.rank``: rank among the uncached ones) or to the LRU's tail (``sh.tokens``: among the cached ones)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for k in range(tid, count, nt):
        page = page_of(s, slots, sh.pages, n, first + k)
        out = released(s, page, first + k)
        sh.rank[k] = 1 if out and s.page_cached[page] == 0 else 0
        sh.tokens[k] = 1 if out and s.page_cached[page] != 0 else 0
    cuda.syncthreads()
    n_free = exclusive_scan(sh.rank, count, sh.partial)
    n_cached = exclusive_scan(sh.tokens, count, sh.partial)
    top = s.sched[0].free_top
    capacity = s.lru_pages.shape[0]
    tail = s.sched[0].lru_head + s.sched[0].lru_count
    for k in range(tid, count, nt):
        page = page_of(s, slots, sh.pages, n, first + k)
        if released(s, page, first + k):
            if s.page_cached[page] != 0:
                position = (tail + sh.tokens[k]) % capacity
                s.lru_pages[position] = page
                s.page_lru[page] = position
            else:
                s.free_pages[top + sh.rank[k]] = page
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].free_top = top + n_free
        s.sched[0].lru_count += n_cached
        s.sched[0].evictable += n_cached
    cuda.syncthreads()


@cuda.jit(device=True)
def compact_lru(s, sh):
    """Drop the LRU ring's stale entries, keeping the live ones in order from ``lru_head``. In place, a window of
    MAX_CANDIDATES entries at a time: a live entry only moves towards the head, into entries already read.
    Scratch: ``sh.tokens`` (live flags), ``sh.rank`` (their ranks), ``sh.chunk`` (the window's pages)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    capacity = s.lru_pages.shape[0]
    head = s.sched[0].lru_head
    count = s.sched[0].lru_count
    kept = 0
    for first in range(0, count, MAX_CANDIDATES):
        window = min(MAX_CANDIDATES, count - first)
        for k in range(tid, window, nt):
            position = (head + first + k) % capacity
            page = s.lru_pages[position]
            sh.chunk[k] = page
            sh.tokens[k] = 1 if s.page_lru[page] == position else 0
            sh.rank[k] = sh.tokens[k]
        cuda.syncthreads()
        live = exclusive_scan(sh.rank, window, sh.partial)
        for k in range(tid, window, nt):
            if sh.tokens[k] != 0:
                position = (head + kept + sh.rank[k]) % capacity
                s.lru_pages[position] = sh.chunk[k]
                s.page_lru[sh.chunk[k]] = position
        cuda.syncthreads()
        kept += live
    if tid == 0:
        s.sched[0].lru_count = kept
    cuda.syncthreads()


@cuda.jit(device=True)
def evict(s, sh, count):
    """Move the ``count`` (<= evictable) least recently released evictable pages out of the prefix cache onto the
    free stack, in LRU order. Scratch: ``sh.tokens`` (live flags of a window of the ring), ``sh.rank`` (their
    ranks)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    capacity = s.lru_pages.shape[0]
    while count > 0 and s.sched[0].lru_count > 0:
        head = s.sched[0].lru_head
        window = min(s.sched[0].lru_count, MAX_CANDIDATES)
        for k in range(tid, window, nt):
            position = (head + k) % capacity
            sh.tokens[k] = 1 if s.page_lru[s.lru_pages[position]] == position else 0
            sh.rank[k] = sh.tokens[k]
        cuda.syncthreads()
        live = exclusive_scan(sh.rank, window, sh.partial)
        taken = min(live, count)
        top = s.sched[0].free_top
        for k in range(tid, window, nt):
            if sh.tokens[k] != 0 and sh.rank[k] < taken:
                page = s.lru_pages[(head + k) % capacity]
                forget(s, page)
                s.page_lru[page] = -1
                s.free_pages[top + sh.rank[k]] = page
                if sh.rank[k] == taken - 1:
                    sh.counters[COUNT.lru_end] = k + 1      # entries up to the last page taken are used up
        cuda.syncthreads()
        if tid == 0:
            used = window if taken == live else sh.counters[COUNT.lru_end]
            s.sched[0].lru_head = (head + used) % capacity
            s.sched[0].lru_count -= used
            s.sched[0].free_top = top + taken
            s.sched[0].evictable -= taken
            s.sched[0].cached -= taken
            sh.counters[COUNT.prefix_evictions] += taken
        cuda.syncthreads()
        count -= taken


@cuda.jit(device=True)
def allocate_pages(s, sh, slots, need, n):
    """Append ``need[i]`` pages to the block table of ring slot ``slots[i]``; ``need`` is consumed (scanned).
    Evicts first if the stack is short (scratch: ``sh.tokens``, ``sh.rank``)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    total = exclusive_scan(need, n, sh.partial)
    if total > s.sched[0].free_top:
        evict(s, sh, total - s.sched[0].free_top)
    top = s.sched[0].free_top
    for index in range(tid, total, nt):
        i = locate(need, n, index)
        slot = slots[i]
        page = s.free_pages[top - 1 - index]
        s.seq_pages[slot, s.seq_npages[slot] + index - need[i]] = page
        s.page_ref[page] = 1
    cuda.syncthreads()
    for i in range(tid, n, nt):
        end = need[i + 1] if i + 1 < n else total
        s.seq_npages[slots[i]] += end - need[i]
    if tid == 0:
        s.sched[0].free_top = top - total
    cuda.syncthreads()
