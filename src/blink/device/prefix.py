"""Prefix caching on the GPU: the pages a new request finds, the pages that become findable, generated pages' keys.

A full KV page is findable under the key of its prefix (``blink.ring.hashing``) from the iteration after its K/V
were computed until it is evicted (``kv.evict``, least recently released first, only once the free stack is
empty). Prompt pages' keys come from the ring (the agent hashed them off the GPU's path); the GPU extends each
sequence's chain state by every token it samples (``note_token``), so the pages of an answer are found when the
conversation comes back with it in its prompt.

- Admission (``match``, then ``take_hits`` for the admitted): a queued request finds the longest prefix of its full
  prompt pages in the table, but never its last prompt token, which must be computed to sample from (vLLM's rule):
  at most ``(prompt_len - 1) // page_size`` pages hit. It starts with those pages in its block table (shared,
  ``page_ref`` counts the holders) and ``seq_computed`` at hits x page_size, so every page it writes is its own.
- Caching (``cache_step`` after ``consume``): every page a step filled enters the table, unless its key is there.

Nothing here writes K/V or moves a held page: a page is written only by the one sequence that allocated it, before
it is full; once full and cached it is only read, until nobody holds it and it is evicted.
"""
from __future__ import annotations

from numba import uint64

from blink.device.block import exclusive_scan, locate
from blink.device.kv import hold
from blink.device.numba_compat import add64, cuda, load_volatile, mul64
from blink.device.state import COUNT
from blink.device.table import claim_way, find, mark_new, settle
from blink.ring.hashing import MIX_A, MIX_B, POSITION_MIX, TOKEN_MIX


@cuda.jit(device=True)
def extend(state, token, position, seed):
    """The chain state after ``token`` at ``position`` follows ``state`` (``hashing.token_term``; uint64 words)."""
    x = seed ^ mul64(uint64(token), uint64(TOKEN_MIX)) ^ mul64(uint64(position), uint64(POSITION_MIX))
    x = mul64(x ^ (x >> uint64(30)), uint64(MIX_A))
    x = mul64(x ^ (x >> uint64(27)), uint64(MIX_B))
    return add64(state, x ^ (x >> uint64(31)))


@cuda.jit(device=True)
def note_token(s, slot, position, token, chain, seed, page):
    """``token`` was sampled at ``position`` of ``slot``'s sequence, whose chain state was ``chain``: store and
    return the state after it (``seed``: the ring's ``prefix_seed``); the state after a page's last token (``page``
    tokens a page) is that page's key. With prefix caching only."""
    state = extend(chain, token, position, seed)
    s.seq_hash[slot] = state
    if (position + 1) % page == 0:
        s.seq_keys[slot, position // page] = state
    return state


@cuda.jit(device=True)
def match(s, sh, n):
    """For the queued requests ``sh.slots[0:n]``: copy their prompt keys to ``seq_keys``; ``sh.tokens[i]`` = pages
    of the longest cached prefix, found in ``seq_pages[slot, 0:hits]``; ``sh.rank[i]`` = how many of those are
    evictable (taking them shrinks the free pages). Scratch: ``sh.pages``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    for i in range(tid, n, nt):
        prompt_len = s.seq_prompt_len[sh.slots[i]]
        sh.pages[i] = prompt_len // page
        sh.tokens[i] = (prompt_len - 1) // page         # lowered to the first miss
        sh.rank[i] = 0
    cuda.syncthreads()
    total = exclusive_scan(sh.pages, n, sh.partial)
    for index in range(tid, total, nt):
        i = locate(sh.pages, n, index)
        slot = sh.slots[i]
        j = index - sh.pages[i]
        key = load_volatile(s.prefix_keys[slot], j)
        s.seq_keys[slot, j] = key
        if j < (s.seq_prompt_len[slot] - 1) // page:
            hit = find(s, key)
            s.seq_pages[slot, j] = hit
            if hit < 0:
                cuda.atomic.min(sh.tokens, i, j)
    cuda.syncthreads()
    for index in range(tid, total, nt):
        i = locate(sh.pages, n, index)
        j = index - sh.pages[i]
        if j < sh.tokens[i] and s.page_ref[s.seq_pages[sh.slots[i], j]] == 0:
            cuda.atomic.add(sh.rank, i, 1)
    cuda.syncthreads()


@cuda.jit(device=True)
def take_hits(s, sh, n):
    """The requests ``sh.slots[0:n]`` start holding their first ``sh.tokens[i]`` pages (found by ``match``).
    Scratch: ``sh.pages``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(tid, n, nt):
        sh.pages[i] = sh.tokens[i]
    cuda.syncthreads()
    total = exclusive_scan(sh.pages, n, sh.partial)
    for index in range(tid, total, nt):
        i = locate(sh.pages, n, index)
        hold(s, sh, s.seq_pages[sh.slots[i], index - sh.pages[i]])
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].evictable -= sh.counters[COUNT.unevicted]
        sh.counters[COUNT.unevicted] = 0
    cuda.syncthreads()


@cuda.jit(device=True)
def completed_page(s, sh, slots, done, n, index):
    """(slot, page index) of flat item ``index`` over the pages that ``slots[i]`` filled since ``done[i]`` tokens."""
    i = locate(sh.pages, n, index)
    return slots[i], done[i] // s.cfg[0].page_size + index - sh.pages[i]


@cuda.jit(device=True)
def cache_completed(s, sh, slots, done, n):
    """Put the pages that ``slots[0:n]`` filled since they had ``done[i]`` tokens computed into the table (the
    rounds of ``table.py``'s insert). Scratch: ``sh.pages``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    for i in range(tid, n, nt):
        sh.pages[i] = s.seq_computed[slots[i]] // page - done[i] // page
    cuda.syncthreads()
    total = exclusive_scan(sh.pages, n, sh.partial)
    for index in range(tid, total, nt):
        slot, j = completed_page(s, sh, slots, done, n, index)
        mark_new(s, s.seq_pages[slot, j], s.seq_keys[slot, j])
    cuda.syncthreads()
    for index in range(tid, total, nt):
        slot, j = completed_page(s, sh, slots, done, n, index)
        claim_way(s, s.seq_pages[slot, j])
    cuda.syncthreads()
    for index in range(tid, total, nt):
        slot, j = completed_page(s, sh, slots, done, n, index)
        if settle(s, s.seq_pages[slot, j]):
            cuda.atomic.add(sh.counters, COUNT.inserted, 1)
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].cached += sh.counters[COUNT.inserted]
        sh.counters[COUNT.inserted] = 0
    cuda.syncthreads()


@cuda.jit(device=True)
def cache_step(s, sh):
    """After ``consume``, which left each row's slot in ``sh.slots`` and its tokens computed before the step in
    ``sh.tokens``: the pages the step filled become findable."""
    # Shared memory first: most steps complete no page, and then the configuration's word (a round trip after
    # consume's barrier) is not read.
    if sh.counters[COUNT.completed] != 0 and s.cfg[0].prefix_caching != 0:
        cache_completed(s, sh, sh.slots, sh.tokens, s.sched[0].rows)
