"""Settle's first phase (device functions): what prepare wrote into the ring made visible in the order the agent
relies on, and the device counters and gauges stored into the control block."""
from __future__ import annotations

from numba import int64

from blink.device.kv import free_total
from blink.device.numba_compat import cuda
from blink.device.state import COUNT, SPEC_ACCEPTED_PER_POS
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS
from blink.ring.layout import FINISHED, RUNNING


@cuda.jit(device=True)
def publish(s, sh):
    """Make this iteration's ring writes visible in the order the agent relies on, with ONE fence per thread.

    Every ring write of prepare (tokens, logprobs, finish reasons, zeroed counts of admitted requests) came earlier,
    so by now most have landed and the fence is short. After it: the token counts, RUNNING for prepare's admissions
    (the last ``sched.admitted`` of the running list), and FINISHED for the requests that were pending at the
    PREVIOUS publish (``publishable``): their final count and the counters that count them (``publish_stats``) were
    stored then, before this fence. Requests finished since (retired by this prepare, refused by the last settle's
    collect) are published next time, for the same reason.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sched = s.sched[0]
    consumed = sched.consumed                   # the words thread 0 rewrites at the end, read once before any
    admitted = sched.admitted                   # barrier: every thread sees the same, so the branches below are
    running = sched.running                     # block-uniform
    pending = sched.pending_finished
    published = sched.publishable
    if consumed == 0 and admitted == 0 and pending == 0:
        # Nothing to announce: skip the fence, which costs a PCIe round trip (~2.4 us on the H200) even when idle.
        return
    cuda.threadfence_system()
    cuda.syncthreads()
    for r in range(tid, consumed, nt):
        slot = s.consumed[r]
        if slot >= 0:
            s.ngen[slot] = s.seq_total[slot] - s.seq_prompt_len[slot]
    for i in range(running - admitted + tid, running, nt):
        s.state[s.running[i]] = RUNNING
    for i in range(tid, published, nt):
        slot = s.pending_finished[i]
        s.seq_seen[slot] = 0                # a refused slot leaves READY now: scans may take its next request
        s.state[slot] = FINISHED
    # Requests finished since the last publish move to the front; they are published next time.
    waiting = pending - published
    if waiting != 0 and published != 0:
        cuda.syncthreads()                  # the FINISHED loop read the entries the move overwrites
        for i in range(tid, waiting, nt):
            sh.slots[i] = s.pending_finished[published + i]
        cuda.syncthreads()
        for i in range(tid, waiting, nt):
            s.pending_finished[i] = sh.slots[i]
    if tid == 0:
        sched.pending_finished = waiting
        sched.publishable = waiting
        sched.consumed = 0
    cuda.syncthreads()


@cuda.jit(device=True)
def fold_counts(s, sh):
    """Thread 0, where a part of the iteration ends: add its counts to the device counters of the same name (the
    next ``publish_stats`` stores them into the ring)."""
    stats = s.stats[0]
    counts = sh.counters
    stats.tokens += counts[COUNT.tokens]
    stats.finished += counts[COUNT.finished]
    stats.cancelled += counts[COUNT.cancelled]
    stats.admitted += counts[COUNT.admitted]
    stats.preempted += counts[COUNT.preempted]
    stats.prefix_query_tokens += counts[COUNT.prefix_query_tokens]
    stats.prefix_hit_tokens += counts[COUNT.prefix_hit_tokens]
    stats.prefix_evictions += counts[COUNT.prefix_evictions]
    stats.prefill_tokens += counts[COUNT.prefill_tokens]
    stats.spec_drafts += counts[COUNT.spec_drafts]
    stats.spec_draft_tokens += counts[COUNT.spec_draft_tokens]
    stats.spec_accepted_tokens += counts[COUNT.spec_accepted_tokens]
    for j in range(MAX_SPECULATIVE_TOKENS):
        stats.spec_accepted_per_pos[j] += counts[SPEC_ACCEPTED_PER_POS + j]


@cuda.jit(device=True)
def publish_stats(s):
    """Thread 0: store every device counter (``PUBLISHED_COUNTERS``) and gauge into the control block. Every value
    is read before any is stored: the compiler cannot tell the ring's control block from the device counters, so a
    store waits for its value and the next load waits behind that store, a round trip per counter otherwise (34 in a
    row in the SASS; the fold above needs no such care: one record's fields at known offsets cannot overlap)."""
    stats = s.stats[0]
    control = s.control[0]
    heartbeat = stats.heartbeat
    steps = stats.steps
    tokens = stats.tokens
    admitted = stats.admitted
    finished = stats.finished
    cancelled = stats.cancelled
    preempted = stats.preempted
    prefix_query_tokens = stats.prefix_query_tokens
    prefix_hit_tokens = stats.prefix_hit_tokens
    prefix_evictions = stats.prefix_evictions
    prefill_tokens = stats.prefill_tokens
    spec_drafts = stats.spec_drafts
    spec_draft_tokens = stats.spec_draft_tokens
    spec_accepted_tokens = stats.spec_accepted_tokens
    per_pos = cuda.local.array(MAX_SPECULATIVE_TOKENS, int64)
    for j in range(MAX_SPECULATIVE_TOKENS):
        per_pos[j] = stats.spec_accepted_per_pos[j]
    kv_pages_free = free_total(s)
    running = s.sched[0].running
    waiting = s.sched[0].queued
    cached_pages = s.sched[0].cached
    control.heartbeat = heartbeat
    control.steps = steps
    control.tokens = tokens
    control.admitted = admitted
    control.finished = finished
    control.cancelled = cancelled
    control.preempted = preempted
    control.prefix_query_tokens = prefix_query_tokens
    control.prefix_hit_tokens = prefix_hit_tokens
    control.prefix_evictions = prefix_evictions
    control.prefill_tokens = prefill_tokens
    control.spec_drafts = spec_drafts
    control.spec_draft_tokens = spec_draft_tokens
    control.spec_accepted_tokens = spec_accepted_tokens
    for j in range(MAX_SPECULATIVE_TOKENS):
        control.spec_accepted_per_pos[j] = per_pos[j]
    control.kv_pages_free = kv_pages_free
    control.running = running
    control.waiting = waiting
    control.cached_pages = cached_pages
