"""Admission and step planning (device functions, whole block).

``admit``: requests leave the head of the waiting queue (``waiting.py``, sorted by the admission policy) while
running sequences stay under ``max_num_seqs`` and their whole prompt fits in the free pages above the watermark. The
first one that does not fit blocks the rest (no overtaking), as in vLLM's FCFS. With prefix caching a request starts
with the pages of its longest cached prefix computed (``prefix.py``), and needs only the rest, plus the cached pages
it takes from the evictable ones (they stop being free).

``plan``: every running sequence wants ``total - computed`` tokens (1 for a decode). Decodes come first and always
get their page: while they do not fit, the most recently admitted sequence that holds pages is preempted by
recompute (pages freed, ``computed = 0``; it re-prefills prompt + generated tokens later). A sequence needs only the
pages it lacks (``kv.pages_short``): one that holds pages past its next token (rejected drafts took them) needs none
and lends none. With speculative decoding the decodes' drafts come next (``speculation.propose``). Prefill chunks
then take the rest of the token budget in running order (chunked prefill), each cut to the pages still free. Rows of
the step are the sequences with a chunk, in running order; the step's inputs are written per ``step.py``'s contract
and the smallest captured bucket that holds the tokens is chosen.
"""
from __future__ import annotations

from blink.device import inputs, prefix, speculation
from blink.device.block import exclusive_scan
from blink.device.kv import allocate_pages, free_sequences, free_total, pages_for, pages_short
from blink.device.numba_compat import cuda
from blink.device.profile import lap
from blink.device.state import COUNT, IDLE, PHASE


@cuda.jit(device=True)
def start_sequence(s, slot, index, hits):
    """Move a queued request (its header is already in device memory) to running[index], its first ``hits`` pages
    found in the prefix cache (already in its block table).

    Its output words are zeroed now; ``scheduler.publish`` stores RUNNING after the fence that follows them.
    """
    s.seq_total[slot] = s.seq_prompt_len[slot]
    s.seq_computed[slot] = hits * s.cfg[0].page_size
    s.seq_npages[slot] = hits
    s.seq_finish[slot] = 0
    s.seq_version[slot] += 1
    s.seq_seen[slot] = 0
    s.ngen[slot] = 0
    s.finish[slot] = 0
    s.running[index] = slot


@cuda.jit(device=True)
def admission_cost(s, sh, j):
    """Free pages the j-th request of the window takes: its prompt's, less its cached ones, plus those of them
    that were evictable."""
    return pages_for(s.seq_prompt_len[sh.slots[j]], s.cfg[0].page_size) - sh.tokens[j] + sh.rank[j]


@cuda.jit(device=True)
def admit(s, sh):
    """Admit from the head of the waiting queue while sequences and pages last; the first that does not fit
    blocks the rest (no overtaking). Every request takes at least one free page (its last prompt token is always
    computed), so the window is at most the free pages. ``sched.admitted``: how many (settle publishes them)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    running = s.sched[0].running
    free = free_total(s) - s.cfg[0].watermark
    window = min(s.sched[0].queued, s.cfg[0].max_num_seqs - running, free)
    if window <= 0:
        if tid == 0:
            s.sched[0].admitted = 0             # read by settle only: no barrier needed
        return
    head = s.sched[0].queue_head
    caching = s.cfg[0].prefix_caching != 0
    for j in range(tid, window, nt):            # slots: the window; tokens, rank: cached and evictable pages
        sh.slots[j] = s.queue_slots[head + j]
        sh.tokens[j] = 0
        sh.rank[j] = 0
    cuda.syncthreads()
    if caching:
        prefix.match(s, sh, window)
    for j in range(tid, window, nt):            # pages -> pages the requests before j take
        sh.pages[j] = admission_cost(s, sh, j)
    cuda.syncthreads()
    exclusive_scan(sh.pages, window, sh.partial)
    for j in range(tid, window, nt):
        slot = sh.slots[j]
        if sh.pages[j] + admission_cost(s, sh, j) <= free:
            start_sequence(s, slot, running + j, sh.tokens[j])
            cuda.atomic.add(sh.counters, COUNT.admitted, 1)
            if caching:
                cuda.atomic.add(sh.counters, COUNT.prefix_query_tokens, s.seq_prompt_len[slot])
                cuda.atomic.add(sh.counters, COUNT.prefix_hit_tokens, s.seq_computed[slot])
        else:
            sh.tokens[j] = 0                    # not admitted: holds nothing
    cuda.syncthreads()
    if caching:
        prefix.take_hits(s, sh, window)
    if tid == 0:
        admitted = sh.counters[COUNT.admitted]
        s.sched[0].admitted = admitted
        s.sched[0].running = running + admitted
        s.sched[0].queue_head = head + admitted
        s.sched[0].queued -= admitted
    cuda.syncthreads()


@cuda.jit(device=True)
def preempt_newest(s, sh):
    """Free the pages of the most recently admitted sequence that holds any; it will re-prefill. False if none."""
    tid = cuda.threadIdx.x
    if tid == 0:
        sh.counters[COUNT.victim] = -1
        for i in range(s.sched[0].running - 1, -1, -1):
            if s.seq_npages[s.running[i]] > 0:
                sh.counters[COUNT.victim] = s.running[i]
                sh.slots[0] = s.running[i]
                break
    cuda.syncthreads()
    victim = sh.counters[COUNT.victim]
    if victim < 0:
        return False
    free_sequences(s, sh, sh.slots, 1)
    if tid == 0:
        s.seq_computed[victim] = 0
        s.seq_version[victim] += 1
        sh.counters[COUNT.preempted] += 1
    cuda.syncthreads()
    return True


@cuda.jit(device=True)
def plan_chunks(s, sh, n):
    """Decide each running sequence's chunk ``sh.chunk[i]`` (0: not in this step). Preempts to fit the decodes.

    Returns True when every running sequence decodes (one token each): the steady state, planned without scans.
    Every decode gets its token, since ``max_num_batched_tokens >= max_num_seqs``.
    """
    while True:
        all_decode = chunks_once(s, sh, n)
        # Progress: a step with running sequences but no token (prefills holding every page, no decode to force a
        # preemption) would never end; preempt the newest holder and plan again.
        if all_decode or sh.counters[COUNT.chunked] != 0 or not preempt_newest(s, sh):
            return all_decode


@cuda.jit(device=True)
def chunks_once(s, sh, n):
    """One planning pass (see ``plan_chunks``); counts the sequences that got a chunk in ``COUNT.chunked``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    while True:
        if tid == 0:
            sh.counters[COUNT.prefills] = 0
            sh.counters[COUNT.chunked] = 0
            sh.counters[COUNT.decode_pages] = 0
        cuda.syncthreads()
        for i in range(tid, n, nt):
            slot = s.running[i]
            computed = s.seq_computed[slot]
            if s.seq_total[slot] - computed == 1:
                sh.chunk[i] = 1
                cuda.atomic.add(sh.counters, COUNT.decode_pages, pages_short(s, slot, computed + 1))
            else:
                sh.chunk[i] = 0
                cuda.atomic.add(sh.counters, COUNT.prefills, 1)
        cuda.syncthreads()
        if sh.counters[COUNT.decode_pages] <= free_total(s) or not preempt_newest(s, sh):
            break
    if s.cfg[0].spec_tokens > 0:
        speculation.propose(s, sh, n)       # the decodes' drafts, before the prefill chunks share what is left
    n_prefill = sh.counters[COUNT.prefills]
    if n_prefill == 0:
        return True
    tokens_left = s.cfg[0].token_budget - (n - n_prefill) - sh.counters[COUNT.spec_draft_tokens]
    pages_left = free_total(s) - sh.counters[COUNT.decode_pages]
    # Prefill chunks in running order: tokens = tokens wanted by earlier prefills; pages = their pages.
    for i in range(tid, n, nt):
        slot = s.running[i]
        remaining = s.seq_total[slot] - s.seq_computed[slot]
        sh.tokens[i] = 0 if remaining == 1 else remaining
    cuda.syncthreads()
    exclusive_scan(sh.tokens, n, sh.partial)
    for i in range(tid, n, nt):
        slot = s.running[i]
        computed = s.seq_computed[slot]
        remaining = s.seq_total[slot] - computed
        sh.pages[i] = 0
        if remaining != 1:
            chunk = min(max(tokens_left - sh.tokens[i], 0), remaining)
            sh.pages[i] = pages_short(s, slot, computed + chunk)
            sh.chunk[i] = chunk
    cuda.syncthreads()
    exclusive_scan(sh.pages, n, sh.partial)
    for i in range(tid, n, nt):
        slot = s.running[i]
        computed = s.seq_computed[slot]
        if s.seq_total[slot] - computed != 1 and sh.chunk[i] > 0:
            mine = max(pages_left - sh.pages[i], 0)
            fits = (s.seq_npages[slot] + mine) * page - computed
            sh.chunk[i] = max(0, min(sh.chunk[i], fits))
        if sh.chunk[i] > 0:
            cuda.atomic.add(sh.counters, COUNT.chunked, 1)
    cuda.syncthreads()
    return False


@cuda.jit(device=True)
def decodes_in_place(s, sh, n):
    """The steady state's test, one pass (``plan`` asks only when no drafts can be proposed): True when every running
    sequence decodes (one token) in the row it had in the previous step (same slot and version, so the row's
    block-table entries are its pages up to ``row_pages``), and the pages the decodes lack fit (no preemption). Leaves
    what ``allocate_pages`` takes (``sh.slots``, ``sh.pages``: each sequence's missing pages, ``COUNT.need``) and the
    bucket for ``n`` tokens (``inputs.choose_bucket``). Every thread gets the block's answer. Every word it tests is
    read before the barrier."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    free = free_total(s)
    inputs.choose_bucket(s, sh, n)
    for i in range(tid, n, nt):
        slot = s.running[i]
        computed = s.seq_computed[slot]
        decodes = s.seq_total[slot] - computed == 1
        in_place = (s.row_slot[i] == slot) & (s.row_version[i] == s.seq_version[slot])    # &: the loads at once
        need = pages_short(s, slot, computed + 1)
        sh.slots[i] = slot
        sh.pages[i] = need
        if need != 0:
            cuda.atomic.add(sh.counters, COUNT.need, need)
        if not (decodes and in_place):
            cuda.atomic.add(sh.counters, COUNT.moved, 1)
    cuda.syncthreads()
    return sh.counters[COUNT.moved] == 0 and sh.counters[COUNT.need] <= free


@cuda.jit(device=True)
def plan_decodes(s, sh, n, t):
    """Plan the steady state (``decodes_in_place``): the decodes' missing pages, then their rows in one pass
    (``inputs.write_decodes``). Returns the bucket and the clock after the pages' lap (``t``: after the chunks')."""
    if sh.counters[COUNT.need] != 0:
        allocate_pages(s, sh, sh.slots, sh.pages, n)
    t = lap(sh, t, PHASE.pages)
    inputs.write_decodes(s, sh, n)
    return sh.counters[COUNT.bucket], t


@cuda.jit(device=True)
def plan_rows(s, sh, n, t):
    """Plan any step: chunks (preempting to fit the decodes), drafts, pages; rows in running order; the step's
    inputs per ``inputs.py``. Returns (rows, bucket, the clock after the pages' lap); ``t``: where planning started
    (the steady state's test, when it ran, is in the chunks' lap)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    all_decode = plan_chunks(s, sh, n)
    t = lap(sh, t, PHASE.chunks)
    drafting = sh.counters[COUNT.spec_drafts] != 0
    for i in range(tid, n, nt):
        slot = s.running[i]
        need = pages_short(s, slot, s.seq_computed[slot] + sh.chunk[i])     # read before the stores
        sh.slots[i] = slot
        sh.pages[i] = need
        if need != 0:
            cuda.atomic.add(sh.counters, COUNT.need, need)
    cuda.syncthreads()
    if sh.counters[COUNT.need] != 0:
        allocate_pages(s, sh, sh.slots, sh.pages, n)
    t = lap(sh, t, PHASE.pages)
    # Rows are the sequences with a chunk, in running order: rank = first row index, tokens = first token row; a
    # sequence verifying k drafts takes k + 1 rows of one token each.
    if all_decode and not drafting:
        for i in range(tid, n, nt):
            sh.rank[i] = i
            sh.tokens[i] = i
        cuda.syncthreads()
        n_rows = n
        n_tokens = n
    else:
        for i in range(tid, n, nt):
            sh.rank[i] = 1 + s.seq_ndraft[s.running[i]] if sh.chunk[i] > 0 else 0
            sh.tokens[i] = sh.chunk[i]
        cuda.syncthreads()
        n_rows = exclusive_scan(sh.rank, n, sh.partial)
        n_tokens = exclusive_scan(sh.tokens, n, sh.partial)
    if n_tokens == 0:
        return n_rows, IDLE, t
    inputs.choose_bucket(s, sh, n_tokens)
    inputs.write_rows(s, sh, n)                 # ends with a barrier: the bucket is in
    bucket = sh.counters[COUNT.bucket]
    if tid == 0:
        s.query_start_loc[n_rows] = n_tokens
        s.attn_query_start_loc[n_rows] = n_tokens
        s.num_seqs[0] = n_rows
    cuda.syncthreads()
    inputs.write_tables_and_tokens(s, sh, n_rows, n_tokens, all_decode)
    inputs.pad(s, n_rows, n_tokens, sh.counters[COUNT.bucket_tokens])
    return n_rows, bucket, t


@cuda.jit(device=True)
def plan(s, sh, t):
    """Plan the next step and write its inputs; return the bucket index to launch, or IDLE. The steady state (every
    running sequence decoding in its row of the previous step) takes ``plan_decodes``, any other ``plan_rows``; both
    write the same inputs for it (tests/device/test_batcher.py). ``t``: the clock where planning starts; every path
    laps its three phases (``PHASE.chunks``, ``pages``, ``inputs``)."""
    tid = cuda.threadIdx.x
    n = s.sched[0].running
    if n == 0:
        if tid == 0:
            s.sched[0].rows = 0
            s.sched[0].bucket = IDLE
        cuda.syncthreads()
        lap(sh, lap(sh, lap(sh, t, PHASE.chunks), PHASE.pages), PHASE.inputs)
        return IDLE
    steady = False
    if s.cfg[0].spec_tokens == 0:               # with drafts a plan is never the steady state: no test to pay for
        steady = decodes_in_place(s, sh, n)
        if not steady:
            cuda.syncthreads()                  # every thread has the test's answer: its count may go
            if tid == 0:
                sh.counters[COUNT.need] = 0
            cuda.syncthreads()
    if steady:
        n_rows = n
        bucket, t = plan_decodes(s, sh, n, lap(sh, t, PHASE.chunks))
    else:
        n_rows, bucket, t = plan_rows(s, sh, n, t)
    if tid == 0:
        s.sched[0].rows = n_rows
        s.sched[0].bucket = bucket
    cuda.syncthreads()
    lap(sh, t, PHASE.inputs)
    return bucket
