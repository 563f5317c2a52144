"""The prefix cache's hash table in device memory: prefix key (``blink.ring.hashing``) -> KV page.

Set-associative open addressing: key ``k`` lives in bucket ``k mod n_buckets`` (a power of two), in any of its
``PREFIX_WAYS`` ways: ``table_keys / table_pages[bucket * PREFIX_WAYS + way]``, ``table_pages == -1`` for an empty
way. A lookup reads one bucket, so no probe sequence exists and a removal just empties its way (no tombstones: a
table that serves for days never slows down). With ``table_entries(num_pages) >= 2 x num_pages`` a bucket of 16 is
full at most about 1% of the time even with every page cached (Poisson(8) >= 16: 0.8%); an insert into a full bucket
is refused and the page just stays uncached.

Invariants: a page is in the table at most once, exactly when ``page_cached[page]``, under ``page_key[page]``; a key
is in the table at most once (an insert pass resolves a key inserted twice to the smallest page).

Inserting is a block-wide pass in three rounds over the items (pages), each round a loop ``for item in range(tid,
n, nthreads)`` separated by barriers: ``mark_new`` (the key is not in the table yet), ``claim_way``, ``settle``
(a claim that lost to a smaller page with the same key gives its way back).
"""
from __future__ import annotations

from numba import int32, int64, uint64

from blink.device.numba_compat import cuda
from blink.device.state import PREFIX_WAYS, SCRATCH_CLEAR

NEW = 1         # page_scratch of a page whose key was not in the table at the start of an insert pass


@cuda.jit(device=True)
def bucket_start(s, key):
    """Index of the first way of ``key``'s bucket."""
    n_buckets = s.table_pages.shape[0] // PREFIX_WAYS
    return int64(key & uint64(n_buckets - 1)) * PREFIX_WAYS


@cuda.jit(device=True)
def find(s, key):
    """The page cached under ``key``, or -1."""
    start = bucket_start(s, key)
    for way in range(start, start + PREFIX_WAYS):
        page = s.table_pages[way]
        if page >= 0 and s.table_keys[way] == key:
            return page
    return -1


@cuda.jit(device=True)
def forget(s, page):
    """Take a cached page out of the table (one thread per page)."""
    start = bucket_start(s, s.page_key[page])
    for way in range(start, start + PREFIX_WAYS):
        if s.table_pages[way] == page:
            s.table_pages[way] = -1
    s.page_cached[page] = 0


@cuda.jit(device=True)
def mark_new(s, page, key):
    """Round 1 of an insert: remember ``key`` as the page's, and whether the table lacks it (``page_scratch``)."""
    s.page_key[page] = key
    if find(s, key) < 0:
        s.page_scratch[page] = NEW


@cuda.jit(device=True)
def claim_way(s, page):
    """Round 2: a page marked new takes an empty way of its bucket (atomically: others claim at the same time)."""
    if s.page_scratch[page] != NEW:
        return
    key = s.page_key[page]
    start = bucket_start(s, key)
    for way in range(start, start + PREFIX_WAYS):
        if cuda.atomic.cas(s.table_pages, way, int32(-1), int32(page)) == -1:
            s.table_keys[way] = key
            s.page_cached[page] = 1
            return


@cuda.jit(device=True)
def settle(s, page):
    """Round 3: a claim gives its way back to a smaller page of the same key (claimed in this pass, since round 1
    found none before it); the smallest never does, so every other sees it and one page per key stays. Returns
    whether ``page`` is cached now; clears its scratch word."""
    s.page_scratch[page] = SCRATCH_CLEAR
    if s.page_cached[page] == 0:
        return False
    key = s.page_key[page]
    start = bucket_start(s, key)
    for way in range(start, start + PREFIX_WAYS):
        other = s.table_pages[way]
        if 0 <= other < page and s.table_keys[way] == key:
            forget(s, page)
            return False
    return True

