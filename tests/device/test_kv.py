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
from numba import uint64

from tests.device.pages import check_pages, live_lru, table_contents
from tests.device.phases import launch, save_counters, scheduler_arrays

from blink.device.config import SchedulerConfig
from blink.device.kv import allocate_pages, free_sequences
from blink.device.mirror import KVMirror
from blink.device.numba_compat import cuda
from blink.device.prefix import cache_completed, match, note_token, take_hits
from blink.device.scheduler import scratch
from blink.device.state import COUNT, MAX_CANDIDATES, N_COUNTERS, PREFIX_WAYS
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

    def __init__(self, threads, config=CONFIG, geometry=GEOMETRY):
        self.view, self.s = scheduler_arrays(geometry, config)
        self.s.stats[0].prefix_seed = SEED
        self.threads, self.mirror, self.page = threads, KVMirror(config.num_pages), config.page_size
        self.tokens, self.prompt, self.computed = {}, {}, {}

    def keys(self, slot):
        return reference_keys(self.tokens[slot], self.page, SEED)[0]

    def admit(self, requests):
        """``(slot, tokens, prompt_len)`` of idle slots."""
        s = self.s
        for slot, tokens, prompt_len in requests:
            self.tokens[slot], self.prompt[slot] = tokens, prompt_len
            keys = self.keys(slot)
            self.view.prefix_keys[slot, :prompt_len // self.page] = keys[:prompt_len // self.page]
            s.seq_keys[slot, :len(keys)] = keys          # generated pages' keys: what note_token leaves
            s.seq_prompt_len[slot] = prompt_len
        hits, evictable = np.zeros(len(requests) + 1, np.int32), np.zeros(len(requests) + 1, np.int32)
        launch(admit_kernel, self.threads, s, i32(r[0] for r in requests), i32([len(requests)]), hits, evictable)
        found = [self.mirror.lookup(self.keys(slot)[:(prompt_len - 1) // self.page])
                 for slot, _, prompt_len in requests]
        for i, ((slot, _, _), pages) in enumerate(zip(requests, found)):
            assert hits[i] == len(pages)
            assert evictable[i] == sum(self.mirror.ref[p] == 0 for p in pages), "as before this admission"
        for (slot, _, _), pages in zip(requests, found):
            self.mirror.hold(slot, pages)
            self.computed[slot] = len(pages) * self.page

    def compute(self, chunks):
        """``(slot, tokens)``: allocate what the chunks need, compute them, cache the pages they filled."""
        s, m = self.s, self.mirror
        need = [-(-(self.computed[slot] + k) // self.page) - len(m.tables.get(slot, [])) for slot, k in chunks]
        if sum(need) > m.free_total:
            return
        counters = np.zeros(N_COUNTERS, np.int32)
        slots = i32(slot for slot, _ in chunks)
        launch(allocate_kernel, self.threads, s, slots, i32(need), i32([len(chunks)]), counters)
        evicted_before = m.evicted
        m.allocate([slot for slot, _ in chunks], need)
        assert counters[COUNT.prefix_evictions] == m.evicted - evicted_before
        done = [self.computed[slot] for slot, _ in chunks]
        items = []
        for slot, k in chunks:
            keys, table = self.keys(slot), m.tables[slot]
            first, end = self.computed[slot] // self.page, (self.computed[slot] + k) // self.page
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
        assert s.free_pages[:s.sched[0].free_top].tolist() == m.free
        assert live_lru(s) == m.lru
        assert s.page_ref.tolist() == m.ref
        assert table_contents(s) == m.table
        for slot in range(len(self.s.seq_npages)):
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
    assert not pool.s.page_ref.any() and len(live_lru(pool.s)) + int(pool.s.sched[0].free_top) == NUM_PAGES


# -- named cases ----------------------------------------------------------------------------------------------------


def serve(pool, slot, tokens, prompt_len=None):
    """Admit ``tokens`` into ``slot``, compute them all, compare."""
    pool.admit([(slot, tokens, prompt_len or len(tokens))])
    pool.compute([(slot, len(tokens) - pool.computed[slot])])
    pool.compare()


def test_released_pages_join_the_lru_last_page_first_and_a_hit_takes_them_back():
    pool = Pool(threads=3)
    serve(pool, 0, BASES[0])                                  # 4 full pages, all cached
    table = list(pool.mirror.tables[0])
    pool.free([0], preempt=False)
    assert live_lru(pool.s) == table[::-1], "a prefix's first page is evicted last"
    serve(pool, 1, BASES[0])                                  # 3 pages hit; the last one is computed again
    assert pool.mirror.tables[1][:3] == table[:3] and live_lru(pool.s) == [table[3]]
    pool.free([1], preempt=False)
    assert live_lru(pool.s) == [table[3], table[2], table[1], table[0]]     # the recomputed page is a duplicate
    pool.compare()


def test_stale_lru_entries_are_compacted_away_in_order():
    """Each hit leaves stale entries behind; once the ring (2 x num_pages) would overflow they are dropped."""
    pool = Pool(threads=4)
    serve(pool, 0, BASES[0])
    pool.free([0], preempt=False)
    counts = []
    for cycle in range(8):
        serve(pool, 1 + cycle % 2, BASES[0])
        pool.free([1 + cycle % 2], preempt=False)
        counts.append(int(pool.s.sched[0].lru_count))
    assert max(counts) <= 2 * NUM_PAGES and any(b < a for a, b in zip(counts, counts[1:])), counts
    pool.compare()


def test_more_pages_than_one_window_of_scratch():
    """Releases and evictions of more than MAX_CANDIDATES pages run in several windows, in order."""
    pages = MAX_CANDIDATES + 40
    geometry = RingGeometry(n_slots=2, max_prompt_tokens=pages - 1, max_output_tokens=1, max_stop_ids=0,
                            logprobs=False, prefix_page_size=1)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, page_size=1, num_pages=pages,
                             max_model_len=pages)
    pool = Pool(4, config, geometry)
    first, second = list(range(pages)), list(range(1, pages + 1))
    serve(pool, 0, first, prompt_len=pages - 1)
    pool.free([0], preempt=False)
    assert len(live_lru(pool.s)) == pages
    serve(pool, 1, second, prompt_len=pages - 1)    # no hit (another first token): every cached page is evicted
    assert pool.mirror.evicted == pages


def test_a_full_bucket_refuses_the_insert_and_the_page_stays_uncached():
    geometry = RingGeometry(n_slots=2, max_prompt_tokens=24, max_output_tokens=1, max_stop_ids=0, logprobs=False,
                            prefix_page_size=PAGE)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, page_size=PAGE, num_pages=26,
                             max_model_len=25)
    pool = Pool(3, config, geometry)
    pool.s = pool.s._replace(table_keys=np.zeros(PREFIX_WAYS, np.uint64),         # one bucket
                             table_pages=np.full(PREFIX_WAYS, -1, np.int32))
    pool.admit([(0, list(range(20, 44)), 24)])
    pool.compute([(0, 24)])                    # 12 full pages, 16 ways: all fit
    pool.admit([(1, list(range(50, 74)), 24)])
    pool.compute([(1, 24)])                    # 12 more: 4 fit
    assert int(pool.s.page_cached.sum()) == PREFIX_WAYS
    check_pages(pool.s, [0, 1])
    pool.free([0, 1], preempt=False)
    check_pages(pool.s, [])
    assert len(live_lru(pool.s)) == PREFIX_WAYS and int(pool.s.sched[0].free_top) == 26 - PREFIX_WAYS


@cuda.jit
def note_kernel(s, slot, first, tokens):
    """One thread samples ``tokens`` at positions ``first, first + 1, ...`` of ``slot``."""
    if cuda.threadIdx.x == 0:
        chain = s.seq_hash[slot[0]]
        for k in range(tokens.shape[0]):
            chain = note_token(s, slot[0], first[0] + k, tokens[k], chain, uint64(s.stats[0].prefix_seed),
                               s.cfg[0].page_size)


def test_the_gpu_hashes_generated_pages_as_the_agent_hashes_prompts():
    pool = Pool(threads=1)
    prompt, generated = [5, 6, 7], [8, 9, 10, 11, 12, 13]
    keys, state = reference_keys(prompt + generated, PAGE, SEED)
    pool.s.seq_hash[2] = reference_keys(prompt, PAGE, SEED)[1]
    pool.s.seq_keys[2] = 0
    launch(note_kernel, 1, pool.s, i32([2]), i32([len(prompt)]), np.array(generated, np.int32))
    assert pool.s.seq_keys[2, 1:len(keys)].tolist() == keys[1:] and pool.s.seq_hash[2] == state
