"""The page allocator and the prefix cache (``kv.py``, ``table.py``; ``prefix.py``'s match, take_hits and
cache_completed) under the CUDA simulator, against ``KVMirror``.

Random operations on a few ring slots whose token sequences share prefixes: admissions (the longest cached prefix
is found and held), computed chunks (pages allocated, evicting when the stack runs dry; the pages they fill are
cached, a key inserted twice in one pass keeping its smallest page), and finishes, cancels and preemptions (their
pages released together). After every operation each device word is compared with the mirror and the invariants of
``pages.check_pages`` hold (no page both free and held, refcounts = block-table references, the table = the cached
pages); at the end everything is released and no page is lost.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device.pages import check_pages, live_lru, table_contents
from tests.device.phases import launch, save_counters, scheduler_arrays, scratch

from blink.device.config import SchedulerConfig
from blink.device.kv import allocate_pages, free_sequences
from blink.device.mirror import KVMirror
from blink.device.numba_compat import cuda
from blink.device.prefix import cache_completed, match, take_hits
from blink.device.state import FREE_TOP, K_EVICTED, N_COUNTERS, PREFIX_WAYS
from blink.ring.geometry import RingGeometry
from blink.ring.hashing import reference_keys

PAGE, NUM_PAGES, MAX_TOKENS = 2, 10, 12
assert NUM_PAGES <= PREFIX_WAYS, "no bucket can overflow: KVMirror's assumption"
GEOMETRY = RingGeometry(n_slots=6, max_prompt_tokens=MAX_TOKENS, max_output_tokens=4, max_stop_ids=0, logprobs=False,
                        prefix_page_size=PAGE)
CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, page_size=PAGE, num_pages=NUM_PAGES,
                         max_model_len=MAX_TOKENS + 4)
SEED = 0x0123456789ABCDEF
BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7])


@cuda.jit
def admit_kernel(s, slots, n, hits, evictable):
    """Admission's part: match, the block tables start with the hits (as start_sequence does), take_hits."""
    sh = scratch()
    for i in range(cuda.threadIdx.x, n[0], cuda.blockDim.x):
        sh.slots[i] = slots[i]
    cuda.syncthreads()
    match(s, sh, n[0])
    for i in range(cuda.threadIdx.x, n[0], cuda.blockDim.x):
        s.seq_npages[slots[i]] = sh.tokens[i]
        hits[i] = sh.tokens[i]
        evictable[i] = sh.rank[i]
    cuda.syncthreads()
    take_hits(s, sh, n[0])


@cuda.jit
def allocate_kernel(s, slots, need, n, counters):
    sh = scratch()
    allocate_pages(s, sh, slots, need, n[0])
    save_counters(sh, counters)


@cuda.jit
def cache_kernel(s, slots, done, n):
    sh = scratch()
    cache_completed(s, sh, slots, done, n[0])


@cuda.jit
def free_kernel(s, slots, n):
    sh = scratch()
    free_sequences(s, sh, slots, n[0])


def i32(values):
    return np.array(list(values) + [0], np.int32)      # never empty: the simulator wants a real array


class Pool:
    """The device arrays and the mirror, driven together; ``tokens[slot]``: each running sequence's tokens, of
    which ``prompt[slot]`` are its prompt and ``computed[slot]`` have their K/V."""

    def __init__(self, threads):
        self.view, self.s = scheduler_arrays(GEOMETRY, CONFIG)
        self.s.stats[:] = 0
        self.threads, self.mirror = threads, KVMirror(NUM_PAGES)
        self.tokens, self.prompt, self.computed = {}, {}, {}

    def keys(self, slot):
        return reference_keys(self.tokens[slot], PAGE, SEED)[0]

    def admit(self, requests):
        """``(slot, tokens, prompt_len)`` of idle slots."""
        s = self.s
        for slot, tokens, prompt_len in requests:
            self.tokens[slot], self.prompt[slot] = tokens, prompt_len
            keys = self.keys(slot)
            self.view.prefix_keys[slot, :prompt_len // PAGE] = keys[:prompt_len // PAGE]
            s.seq_keys[slot, :len(keys)] = keys          # generated pages' keys: what note_token leaves
            s.seq_prompt_len[slot] = prompt_len
        hits, evictable = np.zeros(len(requests) + 1, np.int32), np.zeros(len(requests) + 1, np.int32)
        launch(admit_kernel, self.threads, s, i32(r[0] for r in requests), i32([len(requests)]), hits, evictable)
        found = [self.mirror.lookup(self.keys(slot)[:(prompt_len - 1) // PAGE]) for slot, _, prompt_len in requests]
        for i, ((slot, _, _), pages) in enumerate(zip(requests, found)):
            assert hits[i] == len(pages)
            assert evictable[i] == sum(self.mirror.ref[p] == 0 for p in pages), "as before this admission"
        for (slot, _, _), pages in zip(requests, found):
            self.mirror.hold(slot, pages)
            self.computed[slot] = len(pages) * PAGE

    def compute(self, chunks):
        """``(slot, tokens)``: allocate what the chunks need, compute them, cache the pages they filled."""
        s, m = self.s, self.mirror
        need = [-(-(self.computed[slot] + k) // PAGE) - len(m.tables.get(slot, [])) for slot, k in chunks]
        if sum(need) > m.free_total:
            return
        counters = np.zeros(N_COUNTERS, np.int32)
        slots = i32(slot for slot, _ in chunks)
        launch(allocate_kernel, self.threads, s, slots, i32(need), i32([len(chunks)]), counters)
        evicted_before = m.evicted
        m.allocate([slot for slot, _ in chunks], need)
        assert counters[K_EVICTED] == m.evicted - evicted_before
        done = [self.computed[slot] for slot, _ in chunks]
        items = []
        for slot, k in chunks:
            keys, table = self.keys(slot), m.tables[slot]
            first, end = self.computed[slot] // PAGE, (self.computed[slot] + k) // PAGE
            items += [(table[j], keys[j]) for j in range(first, end)]
            self.computed[slot] += k
            s.seq_computed[slot] = self.computed[slot]
        launch(cache_kernel, self.threads, s, slots, i32(done), i32([len(chunks)]))
        m.insert(items)

    def free(self, slots, preempt):
        """Finish or cancel ``slots`` (preempt: they stay, with nothing computed)."""
        launch(free_kernel, self.threads, self.s, i32(slots), i32([len(slots)]))
        self.mirror.free_sequences(slots)
        for slot in slots:
            self.computed[slot] = 0
            if not preempt:
                del self.tokens[slot], self.prompt[slot], self.computed[slot]

    def compare(self):
        s, m = self.s, self.mirror
        assert s.free_pages[:s.sched[FREE_TOP]].tolist() == m.free
        assert live_lru(s) == m.lru
        assert s.page_ref.tolist() == m.ref
        assert table_contents(s) == m.table
        for slot in range(GEOMETRY.n_slots):
            assert s.seq_pages[slot, :s.seq_npages[slot]].tolist() == m.tables.get(slot, [])
        check_pages(s, list(m.tables))


sequence = st.tuples(st.sampled_from(range(len(BASES))), st.integers(0, 8), st.lists(st.integers(0, 2), max_size=4),
                     st.integers(1, MAX_TOKENS))
compute = st.tuples(st.just("compute"), st.lists(st.tuples(st.integers(0, 5), st.integers(1, MAX_TOKENS)),
                                                 min_size=1, max_size=4))
operation = st.one_of(st.tuples(st.just("admit"), st.lists(sequence, min_size=1, max_size=3)), compute,
                      st.tuples(st.just("free"), st.lists(st.integers(0, 5), min_size=1, max_size=3), st.booleans()),
                      st.tuples(st.just("serve"), sequence))


def admit(pool, sequences) -> list[int]:
    """Admit ``sequences`` into idle slots; returns the slots."""
    idle = [slot for slot in range(GEOMETRY.n_slots) if slot not in pool.tokens]
    requests = []
    for slot, (base, cut, tail, prompt_len) in zip(idle, sequences):
        tokens = (BASES[base][:cut] + tail)[:MAX_TOKENS]
        if tokens:
            requests.append((slot, tokens, min(prompt_len, len(tokens))))
    if requests:
        pool.admit(requests)
    return [slot for slot, _, _ in requests]


def play(pool, op):
    """One operation; "serve": admit a sequence, compute all of it (if the pages fit), finish the oldest other."""
    kind, args = op[0], op[1]
    if kind == "admit":
        admit(pool, args)
    elif kind == "serve":
        for slot in admit(pool, [args]):
            pool.compute([(slot, len(pool.tokens[slot]) - pool.computed[slot])])
            others = [other for other in pool.tokens if other != slot]
            if others:
                pool.free(others[:1], preempt=False)
    elif kind == "compute":
        chunks = {}
        for slot, k in args:
            if slot in pool.tokens and slot not in chunks:
                k = min(k, len(pool.tokens[slot]) - pool.computed[slot])
                if k > 0:
                    chunks[slot] = k
        if chunks:
            pool.compute(list(chunks.items()))
    else:
        slots = sorted({slot for slot in args if slot in pool.tokens})
        if slots:
            pool.free(slots, preempt=op[2])


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(operation, max_size=24), threads=st.sampled_from([1, 3, 4]))
def test_pages_and_prefix_cache_match_the_mirror(ops, threads):
    pool = Pool(threads)
    for op in ops:
        play(pool, op)
        pool.compare()
    if pool.tokens:
        pool.free(sorted(pool.tokens), preempt=False)
        pool.compare()
    assert not pool.s.page_ref.any() and len(live_lru(pool.s)) + int(pool.s.sched[FREE_TOP]) == NUM_PAGES
