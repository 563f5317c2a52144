"""The waiting queue: READY requests the GPU has seen, sorted by ``(policy key, slot)``, in device memory.

Requests enter the queue when the agent's ``submitted`` doorbell moves: ``collect`` scans the ring's state column for
READY slots not yet queued, finishes cancelled ones ("abort") and unservable ones ("error") on the spot, copies the
header of the others into device memory (and the grammar placements they follow that device memory lacks:
``grammar.mirror``) and keys them with the admission policy; ``enqueue`` sorts the new keys and
merges them into the queue. Admission (``batcher.admit``) pops a prefix from the head, so a backlog costs nothing per
iteration. Entries live at ``queue_slots/queue_keys[head : head + count]`` (``sched.queue_head``, ``sched.queued``);
``seq_seen[slot]`` marks queued slots (QUEUED) and refused ones whose FINISHED is not yet published (REFUSED), so a
rescan never takes a slot twice.

A scan keeps at most MAX_CANDIDATES new requests; when more were READY it asks for another scan next iteration, so a
burst of more than that many requests is merged in several rounds (older ones may then be admitted after newer).
"""
from __future__ import annotations

from numba import int32, int64, uint32

from blink.device import grammar, sampling
from blink.device.block import next_power_of_two, sort_pairs
from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import COUNT, MAX_CANDIDATES, QUEUED, REFUSED
from blink.ring.layout import FINISH_ABORT, FINISH_ERROR, READY

SCAN_UNROLL = 8     # state words each thread has in flight at once: the column is read across PCIe


@cuda.jit(device=True)
def cancelled(s, slot):
    c = load_volatile(s.cancel, slot)
    return c != 0 and c == load_volatile(s.epoch, slot)


@cuda.jit(device=True)
def servable(s, slot):
    """Whether the header of ``slot`` describes a request this scheduler can ever run. Every field is read before
    any is compared, and the comparisons are joined with ``&``: the header crosses PCIe, and a comparison that
    decided whether the next field is read would wait a round trip per field."""
    header = s.headers[slot]
    prompt_len = int32(header.prompt_len)       # as int32, the type the scheduler keeps them in
    max_tokens = int32(header.max_tokens)
    n_stop = int32(header.n_stop)
    n_bias = int32(header.n_logit_bias)
    top = int32(header.top_logprobs)
    flags = header.request_flags
    base = int32(header.grammar)
    fields = ((1 <= prompt_len) & (prompt_len <= s.prompts.shape[1]) & (1 <= max_tokens)
              & (max_tokens <= s.outputs.shape[1]) & (0 <= n_stop) & (n_stop <= s.cfg[0].max_stop)
              & (prompt_len + max_tokens <= s.cfg[0].max_model_len) & sampling.fits(s, n_bias, top))
    return fields & grammar.fits(s, flags, base)


@cuda.jit(device=True)
def load_header(s, slot):
    """Copy what the scheduler needs of the request's header into device memory, each field read before any is
    stored (``sampling.load_sampling`` says why)."""
    header = s.headers[slot]
    prompt_len = header.prompt_len
    max_tokens = header.max_tokens
    request_flags = header.request_flags
    num_speculative_tokens = header.num_speculative_tokens
    n_stop = int32(header.n_stop)
    prefix_state = header.prefix_state
    sampling.load_sampling(s, slot)             # its loads follow these before any store
    s.seq_prompt_len[slot] = prompt_len
    s.seq_max_tokens[slot] = max_tokens
    s.seq_flags[slot] = request_flags
    s.seq_num_speculative_tokens[slot] = num_speculative_tokens
    s.seq_n_stop[slot] = n_stop
    s.seq_hash[slot] = prefix_state             # the prompt's prefix-key chain state (prefix.py)
    for k in range(n_stop):
        s.seq_stop[slot, k] = s.stop_token_ids[slot, k]


@cuda.jit(device=True)
def refuse(s, sh, slot, reason):
    """Finish a READY request that will never run.

    Like a retired request, its FINISHED state is published after the next iteration's fence (``publish``), so the
    agent never sees it finished before the counters (published at the end of this iteration) count it.
    """
    s.seq_seen[slot] = REFUSED
    s.ngen[slot] = 0
    s.finish[slot] = reason
    s.pending_finished[s.sched[0].pending_finished + cuda.atomic.add(sh.counters, COUNT.refused, 1)] = slot
    cuda.atomic.add(sh.counters, COUNT.finished, 1)
    if reason == FINISH_ABORT:
        cuda.atomic.add(sh.counters, COUNT.cancelled, 1)


@cuda.jit(device=True)
def take_new(s, sh, slot, policy):
    """A READY slot seen for the first time: refuse it, or key it as a candidate."""
    if cancelled(s, slot):
        refuse(s, sh, slot, FINISH_ABORT)
        return
    if not servable(s, slot):
        refuse(s, sh, slot, FINISH_ERROR)
        return
    k = cuda.atomic.add(sh.counters, COUNT.new, 1)
    if k >= MAX_CANDIDATES:
        s.stats[0].seen_submitted = -1          # more than fit: scan again next iteration
        return
    header = s.headers[slot]
    arrival_ns = int64(header.arrival_ns)       # read with load_header's fields, before its stores
    priority = header.priority
    request_id = int64(header.request_id)
    load_header(s, slot)
    s.seq_seen[slot] = QUEUED
    sh.slots[k] = slot
    sh.keys[k] = policy(arrival_ns, s.seq_prompt_len[slot], s.seq_max_tokens[slot], priority, request_id)


@cuda.jit(device=True)
def collect(s, sh, policy):
    """Scan the state column for READY slots not yet queued; return how many new candidates are in ``sh``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = s.state.shape[0]
    states = cuda.local.array(SCAN_UNROLL, uint32)
    for base in range(0, n, nt * SCAN_UNROLL):
        for k in range(SCAN_UNROLL):            # constant trip count: the loads are issued back to back
            slot = base + k * nt + tid
            states[k] = load_volatile(s.state, slot) if slot < n else uint32(0)
        for k in range(SCAN_UNROLL):
            slot = base + k * nt + tid
            if slot < n and states[k] == READY and s.seq_seen[slot] == 0:
                take_new(s, sh, slot, policy)
    cuda.syncthreads()
    n_new = min(sh.counters[COUNT.new], MAX_CANDIDATES)
    grammar.mirror(s, sh, n_new)
    return n_new


@cuda.jit(device=True)
def less(key_a, slot_a, key_b, slot_b):
    return key_a < key_b or (key_a == key_b and slot_a < slot_b)


@cuda.jit(device=True)
def rank_in(keys, slots, start, count, key, slot):
    """How many of ``(keys, slots)[start : start + count]`` (sorted) order before ``(key, slot)``."""
    lo = 0
    hi = count
    while lo < hi:
        mid = (lo + hi) // 2
        if less(keys[start + mid], slots[start + mid], key, slot):
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def merge(s, sh, n_new, head, count):
    """The ``n_new`` sorted candidates and the ``count`` queued entries from ``head`` merged into the scratch queue,
    then copied back to the queue's start."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for j in range(tid, n_new, nt):
        position = j + rank_in(s.queue_keys, s.queue_slots, head, count, sh.keys[j], sh.slots[j])
        s.queue_tmp_keys[position] = sh.keys[j]
        s.queue_tmp_slots[position] = sh.slots[j]
    for i in range(tid, count, nt):
        key = s.queue_keys[head + i]
        slot = s.queue_slots[head + i]
        position = i + rank_in(sh.keys, sh.slots, 0, n_new, key, slot)
        s.queue_tmp_keys[position] = key
        s.queue_tmp_slots[position] = slot
    cuda.syncthreads()
    for i in range(tid, count + n_new, nt):
        s.queue_keys[i] = s.queue_tmp_keys[i]
        s.queue_slots[i] = s.queue_tmp_slots[i]


@cuda.jit(device=True)
def enqueue(s, sh, n_new):
    """Sort the new candidates and merge them into the queue (each element finds its place by binary search). An
    empty queue takes the sorted candidates as they are: no merge, and no round trip through the scratch queue and a
    barrier (a request arriving at an idle server is on its first token's path)."""
    if n_new == 0:
        return
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sort_pairs(sh.keys, sh.slots, n_new, next_power_of_two(n_new))
    head = s.sched[0].queue_head
    count = s.sched[0].queued              # the same value in every thread: the branch below is the block's
    if count == 0:
        for j in range(tid, n_new, nt):
            s.queue_keys[j] = sh.keys[j]
            s.queue_slots[j] = sh.slots[j]
    else:
        merge(s, sh, n_new, head, count)
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].queue_head = 0
        s.sched[0].queued = count + n_new
    cuda.syncthreads()


@cuda.jit(device=True)
def cancel_queued(s, sh):
    """After a cancel doorbell: finish queued requests whose cancel word matches, and close the gaps."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    head = s.sched[0].queue_head
    count = s.sched[0].queued
    for i in range(tid, count, nt):
        slot = s.queue_slots[head + i]
        if cancelled(s, slot):
            refuse(s, sh, slot, FINISH_ABORT)
    cuda.syncthreads()
    # Stable compaction into the scratch queue, then back (kept[i] -> position by an atomic-free prefix count).
    if tid == 0:
        kept = 0
        for i in range(count):
            slot = s.queue_slots[head + i]
            if s.seq_seen[slot] == QUEUED:
                s.queue_tmp_slots[kept] = slot
                s.queue_tmp_keys[kept] = s.queue_keys[head + i]
                kept += 1
        sh.counters[COUNT.new] = kept
    cuda.syncthreads()
    kept = sh.counters[COUNT.new]
    for i in range(tid, kept, nt):
        s.queue_slots[i] = s.queue_tmp_slots[i]
        s.queue_keys[i] = s.queue_tmp_keys[i]
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].queue_head = 0
        s.sched[0].queued = kept
        sh.counters[COUNT.new] = 0
    cuda.syncthreads()
