"""What the device's page arrays say, in plain Python: the live LRU, the table's contents, and the invariants of
``kv.py`` and ``table.py`` that every test of the scheduler checks after its operations."""
from __future__ import annotations

from collections import Counter

import numpy as np

from blink.device.state import PREFIX_WAYS, SCRATCH_CLEAR


def live_lru(s) -> list[int]:
    """Evictable pages in LRU order (oldest first): the ring's live entries from its head."""
    capacity = len(s.lru_pages)
    positions = [(int(s.sched[0].lru_head) + k) % capacity for k in range(int(s.sched[0].lru_count))]
    return [int(s.lru_pages[p]) for p in positions if s.page_lru[s.lru_pages[p]] == p]


def table_contents(s) -> dict[int, int]:
    """key -> page of every non-empty way; asserts that no key is there twice and each is in its bucket."""
    contents = {}
    n_buckets = len(s.table_pages) // PREFIX_WAYS
    for way in np.flatnonzero(s.table_pages >= 0):
        key, page = int(s.table_keys[way]), int(s.table_pages[way])
        assert key not in contents, f"key {key:#x} in the table twice"
        assert way // PREFIX_WAYS == key % n_buckets, "a key outside its bucket"
        contents[key] = page
    return contents


def held_pages(s, slots) -> Counter:
    """How many block tables of ``slots`` hold each page."""
    return Counter(int(p) for slot in slots for p in s.seq_pages[slot, :s.seq_npages[slot]])


def check_pages(s, running) -> None:
    """Every page is held (by exactly ``page_ref`` block tables of the running slots), free (on the stack, uncached)
    or evictable (cached, live in the LRU), never two of these; the table holds exactly the cached pages."""
    num_pages = len(s.page_ref)
    held = held_pages(s, running)
    assert all(s.seq_npages[slot] == 0 for slot in range(len(s.seq_npages)) if slot not in set(running)), \
        "a slot that does not run holds pages"
    assert {p: int(s.page_ref[p]) for p in range(num_pages) if s.page_ref[p]} == dict(held), "page_ref"
    free = s.free_pages[:s.sched[0].free_top].tolist()
    evictable = live_lru(s)
    assert len(evictable) == s.sched[0].evictable
    assert sorted(free + evictable + list(held)) == list(range(num_pages)), "a page lost, or in two states"
    assert not any(s.page_cached[p] for p in free), "a cached page on the free stack"
    assert all(s.page_cached[p] for p in evictable), "an uncached page in the LRU"
    cached = {int(p): int(s.page_key[p]) for p in np.flatnonzero(s.page_cached)}
    assert {page: key for key, page in table_contents(s).items()} == cached and len(cached) == s.sched[0].cached
    assert all(s.page_lru[p] == -1 for p in free + list(held)), "a page that is not evictable has a live LRU entry"
    assert (s.page_scratch == SCRATCH_CLEAR).all(), "page_scratch not cleared after a pass"
