"""``KVMirror``: the page allocator and the prefix cache (``kv.py``, ``table.py``) in plain Python, one page at a
time, with exactly the device code's page order: the reference the device code is tested against.

Pages are held (``ref``), free (``free``, a stack, top last) or evictable (``lru``, oldest first); ``cached`` maps a
cached page to its key and ``table`` a key to its page. A table whose buckets never fill is assumed (the tests size
theirs so): the device refuses an insert into a full bucket, and which one it refuses depends on thread timing.
"""
from __future__ import annotations


class KVMirror:
    """The allocator and the prefix cache of ``num_pages`` pages, all free."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))
        self.lru: list[int] = []
        self.ref = [0] * num_pages
        self.cached: dict[int, int] = {}
        self.table: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.evicted = 0

    @property
    def free_total(self) -> int:
        return len(self.free) + len(self.lru)

    def free_sequences(self, slots: list[int]) -> None:
        """Drop the block tables of ``slots``; release, in order over them (each from its last page), every page that
        nobody holds any more: cached ones to the LRU's tail, others onto the stack."""
        items = [page for slot in slots for page in reversed(self.tables.pop(slot, []))]
        for page in items:
            self.ref[page] -= 1
        for page in dict.fromkeys(items):           # each page once, at its first item
            if self.ref[page] == 0:
                (self.lru if page in self.cached else self.free).append(page)

    def evict(self, count: int) -> None:
        """The ``count`` oldest evictable pages leave the cache for the stack, oldest first."""
        for page in self.lru[:count]:
            del self.table[self.cached.pop(page)]
            self.free.append(page)
        self.lru = self.lru[count:]
        self.evicted += count

    def allocate(self, slots: list[int], need: list[int]) -> None:
        total = sum(need)
        if total > self.free_total:
            raise ValueError(f"cannot allocate {total} pages, {self.free_total} free")
        if total > len(self.free):
            self.evict(total - len(self.free))
        for slot, count in zip(slots, need):
            taken = [self.free.pop() for _ in range(count)]
            for page in taken:
                self.ref[page] = 1
            self.tables.setdefault(slot, []).extend(taken)

    def lookup(self, keys: list[int]) -> list[int]:
        """The pages of the longest prefix of ``keys`` that is cached."""
        pages = []
        for key in keys:
            if key not in self.table:
                break
            pages.append(self.table[key])
        return pages

    def hold(self, slot: int, pages: list[int]) -> None:
        """A sequence with no pages yet starts its block table with the cached ``pages``."""
        assert not self.tables.get(slot), "hits start a block table"
        for page in pages:
            if self.ref[page] == 0:
                self.lru.remove(page)
            self.ref[page] += 1
        self.tables[slot] = list(pages)

    def insert(self, items: list[tuple[int, int]]) -> None:
        """``(page, key)`` of newly computed full pages (not cached): each key not cached yet gets its smallest page."""
        for page, key in sorted(items):
            assert page not in self.cached and self.ref[page] > 0
            if key not in self.table:
                self.table[key] = page
                self.cached[page] = key
