"""The GPU-resident scheduler: one iteration of the persistent loop, written as block-wide device functions.

One iteration (``iterate``), run by one thread block:

1. **consume** the previous step's sampled tokens: token (and logprob) into the ring's output area, fence, then
   ``n_generated``; stop checks (EOS unless ignore_eos, stop ids -> "stop"; ``max_tokens`` -> "length");
2. **retire** finished and cancelled sequences: pages back to the free stack, ``finish_reason``, fence, FINISHED;
3. **collect** new READY requests into the waiting queue (``waiting.py``), only when the agent's ``submitted``
   doorbell moved; cancels are looked for only when its ``cancels`` doorbell moved;
4. **admit** from the queue's head (``batcher.admit``), 5. **plan** the next step's inputs (``batcher.plan``);
6. report heartbeat, counters and gauges in the control block; return the bucket to launch, ``IDLE``, or ``STOP``
   (shutdown requested and everything in flight aborted).

All state lives in global memory (``SchedulerArrays``) and nothing is kept between launches, so the same code runs
as a relaunched GPU kernel and as a simulator kernel. The agent writes only the ring: words it may change are read
with ``load_volatile``; counters live in device memory and are only stored to the ring (no read across PCIe).
"""
from __future__ import annotations

from numba import int32, int64

from blink.device import batcher
from blink.device.block import MAX_THREADS, exclusive_scan
from blink.device.kv import free_sequences
from blink.device.numba_compat import clock, cuda, load_volatile
from blink.device.state import (C32_ENGINE_STATE, C32_KV_FREE, C32_RUNNING, C32_SHUTDOWN, C32_WAITING, C64_ADMITTED,
                                C64_CANCELLED, C64_CANCELS, C64_FINISHED, C64_HEARTBEAT, C64_PREEMPTED, C64_STEPS,
                                C64_SUBMITTED, C64_TOKENS, CFG_LOGPROBS, CFG_N_EOS, COUNTERS, DB_CANCELS, DB_SHUTDOWN,
                                DB_SUBMITTED, DB_VALID, FREE_TOP, K_ADMITTED, K_CANCEL_BELL, K_CANCELLED, K_ENDING,
                                K_FINISHED, K_PREEMPTED, K_REFUSED, K_SCAN, K_SHUTDOWN, K_TOKENS, MAX_CANDIDATES,
                                N_CONSUMED, N_COUNTERS, N_PENDING_FINISHED, N_PUBLISHABLE, N_QUEUED, N_ROWS, N_RUNNING,
                                P_ADMIT, P_COLLECT, P_CONSUME, P_DOORBELLS, P_PLAN, P_PUBLISH, P_RETIRE, QUEUE_HEAD,
                                REFUSED, S_SEEN_CANCELS, S_SEEN_SUBMITTED, STOP, Scratch)
from blink.device.waiting import cancel_queued, cancelled, collect, enqueue
from blink.ring.control import ENGINE_SERVING, ENGINE_STOPPED
from blink.ring.layout import (FINISH_ABORT, FINISH_LENGTH, FINISH_NONE, FINISH_STOP, FINISHED, FLAG_IGNORE_EOS,
                               FLAG_LOGPROBS, READY, RUNNING)


@cuda.jit(device=True)
def stop_reason(s, slot, token):
    """Why the request in ``slot`` ends after emitting ``token`` (its ``n``-th token, already counted)."""
    if (s.seq_flags[slot] & FLAG_IGNORE_EOS) == 0:
        for k in range(s.cfg[CFG_N_EOS]):
            if token == s.eos_ids[k]:
                return FINISH_STOP
    for k in range(s.seq_n_stop[slot]):
        if token == s.seq_stop[slot, k]:
            return FINISH_STOP
    if s.seq_total[slot] - s.seq_prompt_len[slot] >= s.seq_max_tokens[slot]:
        return FINISH_LENGTH
    return FINISH_NONE


@cuda.jit(device=True)
def consume(s, sh):
    """Bring the previous step's tokens into the ring's output areas and decide which sequences stop.

    The counts that announce the tokens are published at the end of the iteration (``publish``), after one fence.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for r in range(tid, s.sched[N_ROWS], nt):
        slot = s.row_slot[r]
        s.seq_computed[slot] += s.query_start_loc[r + 1] - s.query_start_loc[r]
        s.consumed[r] = -1
        if s.logits_indices[r] >= 0:
            # Written by the step's kernels on other SMs; a resident scheduler must not read a stale L1 line.
            token = load_volatile(s.sampled_ids, r)
            n = s.seq_total[slot] - s.seq_prompt_len[slot]
            s.outputs[slot, n] = token
            if s.cfg[CFG_LOGPROBS] != 0 and (s.seq_flags[slot] & FLAG_LOGPROBS) != 0:
                s.logprobs[slot, n] = load_volatile(s.sampled_logprobs, r)
            s.consumed[r] = slot                  # n_generated is published after this iteration's fence
            s.seq_total[slot] += 1
            s.seq_last[slot] = token
            s.seq_finish[slot] = stop_reason(s, slot, token)
            cuda.atomic.add(sh.counters, K_TOKENS, 1)
    cuda.syncthreads()


@cuda.jit(device=True)
def retire(s, sh):
    """Finish sequences that stopped or were cancelled; free their pages; compact the running list in order."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = s.sched[N_RUNNING]
    pending = s.sched[N_PENDING_FINISHED]    # read before a barrier: thread 0 rewrites it at the end
    # rank[i]: finishing flag -> finishing sequences before i (a kept sequence moves to i - rank[i]).
    for i in range(tid, n, nt):
        slot = s.running[i]
        reason = s.seq_finish[slot]
        if reason == FINISH_NONE and sh.counters[K_CANCEL_BELL] != 0 and cancelled(s, slot):
            reason = FINISH_ABORT
            s.seq_finish[slot] = reason
        sh.rank[i] = 1 if reason != FINISH_NONE else 0
        if reason != FINISH_NONE:
            cuda.atomic.add(sh.counters, K_ENDING, 1)
    cuda.syncthreads()
    if sh.counters[K_ENDING] == 0:           # the common case: one barrier, no scans
        return
    n_finishing = exclusive_scan(sh.rank, n, sh.partial)
    n_kept = n - n_finishing
    for i in range(tid, n, nt):
        slot = s.running[i]
        if s.seq_finish[slot] != FINISH_NONE:
            sh.slots[sh.rank[i]] = slot
        else:
            sh.kept[i - sh.rank[i]] = slot
    cuda.syncthreads()
    free_sequences(s, sh.slots, n_finishing, sh.pages, sh.partial)
    for i in range(tid, n_finishing, nt):
        slot = sh.slots[i]
        reason = s.seq_finish[slot]
        s.seq_finish[slot] = FINISH_NONE
        s.finish[slot] = reason                   # FINISHED follows in the next iteration's publish
        s.pending_finished[pending + i] = slot
        cuda.atomic.add(sh.counters, K_FINISHED, 1)
        if reason == FINISH_ABORT:
            cuda.atomic.add(sh.counters, K_CANCELLED, 1)
    for i in range(tid, n_kept, nt):
        s.running[i] = sh.kept[i]
    if tid == 0:
        s.sched[N_RUNNING] = n_kept
        s.sched[N_PENDING_FINISHED] = pending + n_finishing
    cuda.syncthreads()


@cuda.jit(device=True)
def publish(s, sh, first_admitted):
    """Make this iteration's ring writes visible in the order the agent relies on, with ONE fence per thread.

    Every ring write of the iteration (tokens, logprobs, finish reasons, zeroed counts of admitted requests) came
    earlier, so by now most have landed and the fence is short. After it: the token counts, RUNNING for this
    iteration's admissions, and FINISHED for the requests that finished in the PREVIOUS iteration: their final count
    was stored then, before this fence. Requests finished now are published next iteration, for the same reason.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    if s.sched[N_CONSUMED] == 0 and sh.counters[K_ADMITTED] == 0 and s.sched[N_PENDING_FINISHED] == 0:
        # Nothing to announce: skip the fence, which costs a PCIe round trip (~2.4 us on the H200) even when idle.
        return
    cuda.threadfence_system()
    cuda.syncthreads()
    for r in range(tid, s.sched[N_CONSUMED], nt):
        slot = s.consumed[r]
        if slot >= 0:
            s.ngen[slot] = s.seq_total[slot] - s.seq_prompt_len[slot]
    for i in range(first_admitted + tid, first_admitted + sh.counters[K_ADMITTED], nt):
        s.state[s.running[i]] = RUNNING
    published = s.sched[N_PUBLISHABLE]
    for i in range(tid, published, nt):
        slot = s.pending_finished[i]
        s.seq_seen[slot] = 0                # a refused slot leaves READY now: scans may take its next request
        s.state[slot] = FINISHED
    cuda.syncthreads()
    # Requests finished this iteration move to the front; they are published next time.
    waiting = s.sched[N_PENDING_FINISHED] - published
    for i in range(tid, waiting, nt):
        sh.slots[i] = s.pending_finished[published + i]
    cuda.syncthreads()
    for i in range(tid, waiting, nt):
        s.pending_finished[i] = sh.slots[i]
    if tid == 0:
        s.sched[N_PENDING_FINISHED] = waiting
        s.sched[N_PUBLISHABLE] = waiting
        s.sched[N_CONSUMED] = 0
    cuda.syncthreads()


@cuda.jit(device=True)
def shut_down(s, sh):
    """Finish every READY (queued or not) and RUNNING request with "abort", free all pages, publish the counters,
    then (after one fence) every FINISHED state and the engine's STOPPED state.

    Slots to mark FINISHED are collected in ``queue_tmp_slots`` (free at shutdown): the running list, the requests
    already finished but not yet published, and every READY slot.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = s.sched[N_RUNNING]
    pending = s.sched[N_PENDING_FINISHED]
    for i in range(tid, n, nt):
        sh.slots[i] = s.running[i]
    cuda.syncthreads()
    free_sequences(s, sh.slots, n, sh.pages, sh.partial)
    for i in range(tid, n, nt):
        slot = sh.slots[i]
        s.seq_finish[slot] = FINISH_NONE
        s.finish[slot] = FINISH_ABORT
        s.queue_tmp_slots[i] = slot
        cuda.atomic.add(sh.counters, K_FINISHED, 1)
        cuda.atomic.add(sh.counters, K_CANCELLED, 1)
    for i in range(tid, pending, nt):
        s.queue_tmp_slots[n + i] = s.pending_finished[i]
    for slot in range(tid, s.state.shape[0], nt):
        if load_volatile(s.state, slot) == READY and s.seq_seen[slot] != REFUSED:   # refused: in pending already
            s.ngen[slot] = 0
            s.finish[slot] = FINISH_ABORT
            s.queue_tmp_slots[n + pending + cuda.atomic.add(sh.counters, K_REFUSED, 1)] = slot
            cuda.atomic.add(sh.counters, K_FINISHED, 1)
            cuda.atomic.add(sh.counters, K_CANCELLED, 1)
    cuda.syncthreads()
    if tid == 0:
        publish_stats(s, sh, False)
    cuda.threadfence_system()
    cuda.syncthreads()
    for i in range(tid, n + pending + sh.counters[K_REFUSED], nt):
        slot = s.queue_tmp_slots[i]
        s.seq_seen[slot] = 0
        s.state[slot] = FINISHED
    cuda.syncthreads()
    if tid == 0:
        s.sched[N_RUNNING] = 0
        s.sched[N_ROWS] = 0
        s.sched[N_QUEUED] = 0
        s.sched[QUEUE_HEAD] = 0
        s.sched[N_PENDING_FINISHED] = 0
        s.sched[N_PUBLISHABLE] = 0
        cuda.threadfence_system()
        s.ctl32[C32_ENGINE_STATE] = ENGINE_STOPPED


@cuda.jit(device=True)
def lap(s, start, phase):
    """Thread 0: add the cycles since ``start`` to the profile word ``phase`` (P_*); return the new start."""
    now = clock()
    if cuda.threadIdx.x == 0:
        s.stats[phase] += now - start
    return now


@cuda.jit(device=True)
def read_doorbells(s, sh):
    """Three threads read shutdown and the two doorbells across PCIe at once; the block then agrees on them.

    A doorbell that moved since last acted on sets K_SCAN / K_CANCEL_BELL. The fire-and-forget loop reads the three
    words while the previous step runs into ``s.doorbells`` (``DB_*``): then no PCIe read is on this path.
    """
    tid = cuda.threadIdx.x
    prefetched = s.doorbells[DB_VALID] != 0   # the resident loop read them while the last step ran (shim.cu)
    cuda.syncthreads()
    if prefetched:
        if tid == 0:
            s.doorbells[DB_VALID] = 0
            sh.counters[K_SHUTDOWN] = s.doorbells[DB_SHUTDOWN]
            if s.doorbells[DB_SUBMITTED] != s.stats[S_SEEN_SUBMITTED]:
                s.stats[S_SEEN_SUBMITTED] = s.doorbells[DB_SUBMITTED]
                sh.counters[K_SCAN] = 1
            if s.doorbells[DB_CANCELS] != s.stats[S_SEEN_CANCELS]:
                s.stats[S_SEEN_CANCELS] = s.doorbells[DB_CANCELS]
                sh.counters[K_CANCEL_BELL] = 1
        cuda.syncthreads()
        return
    if tid == 0:
        sh.counters[K_SHUTDOWN] = load_volatile(s.ctl32, C32_SHUTDOWN)
    if tid == min(1, cuda.blockDim.x - 1):
        submitted = int64(load_volatile(s.ctl64, C64_SUBMITTED))
        if submitted != s.stats[S_SEEN_SUBMITTED]:
            s.stats[S_SEEN_SUBMITTED] = submitted
            sh.counters[K_SCAN] = 1
    if tid == min(2, cuda.blockDim.x - 1):
        cancels = int64(load_volatile(s.ctl64, C64_CANCELS))
        if cancels != s.stats[S_SEEN_CANCELS]:
            s.stats[S_SEEN_CANCELS] = cancels
            sh.counters[K_CANCEL_BELL] = 1
    cuda.syncthreads()


@cuda.jit(device=True)
def publish_stats(s, sh, launched):
    """Thread 0: fold this iteration's counts into the device counters and store them into the control block."""
    s.stats[C64_STEPS] += 1 if launched else 0
    s.stats[C64_TOKENS] += sh.counters[K_TOKENS]
    s.stats[C64_FINISHED] += sh.counters[K_FINISHED]
    s.stats[C64_CANCELLED] += sh.counters[K_CANCELLED]
    s.stats[C64_ADMITTED] += sh.counters[K_ADMITTED]
    s.stats[C64_PREEMPTED] += sh.counters[K_PREEMPTED]
    for k in COUNTERS:
        s.ctl64[k] = s.stats[k]
    s.ctl32[C32_KV_FREE] = s.sched[FREE_TOP]
    s.ctl32[C32_RUNNING] = s.sched[N_RUNNING]
    s.ctl32[C32_WAITING] = s.sched[N_QUEUED]


@cuda.jit(device=True)
def scratch():
    """The iteration's shared-memory work arrays (``Scratch``), its counters zeroed. All threads."""
    # One shared array per line: the CUDA simulator tells shared arrays apart by source line.
    slots = cuda.shared.array(MAX_CANDIDATES, int32)
    keys = cuda.shared.array(MAX_CANDIDATES, int64)
    rank = cuda.shared.array(MAX_CANDIDATES, int32)
    pages = cuda.shared.array(MAX_CANDIDATES, int32)
    tokens = cuda.shared.array(MAX_CANDIDATES, int32)
    chunk = cuda.shared.array(MAX_CANDIDATES, int32)
    kept = cuda.shared.array(MAX_CANDIDATES, int32)
    partial = cuda.shared.array(MAX_THREADS, int32)
    counters = cuda.shared.array(N_COUNTERS, int32)
    for k in range(cuda.threadIdx.x, N_COUNTERS, cuda.blockDim.x):
        counters[k] = 0
    cuda.syncthreads()
    return Scratch(slots, keys, rank, pages, tokens, chunk, kept, partial, counters)


def make_iterate(policy):
    """Build the iteration device function with ``policy`` (see ``blink.device.policy``) ordering admission."""

    @cuda.jit(device=True)
    def iterate(s):
        tid = cuda.threadIdx.x
        sh = scratch()
        t = clock()
        if tid == 0:
            s.stats[C64_HEARTBEAT] += 1
            s.ctl64[C64_HEARTBEAT] = s.stats[C64_HEARTBEAT]
            s.ctl32[C32_ENGINE_STATE] = ENGINE_SERVING
        read_doorbells(s, sh)
        if sh.counters[K_SHUTDOWN] != 0:
            shut_down(s, sh)
            return STOP
        t = lap(s, t, P_DOORBELLS)
        if tid == 0:
            s.sched[N_CONSUMED] = s.sched[N_ROWS]
        consume(s, sh)
        t = lap(s, t, P_CONSUME)
        retire(s, sh)
        t = lap(s, t, P_RETIRE)
        if sh.counters[K_CANCEL_BELL] != 0:
            cancel_queued(s, sh)
        if sh.counters[K_SCAN] != 0:
            enqueue(s, sh, collect(s, sh, policy))
        if tid == 0:                            # refused READY requests are published like finished ones
            s.sched[N_PENDING_FINISHED] += sh.counters[K_REFUSED]
        cuda.syncthreads()
        t = lap(s, t, P_COLLECT)
        first_admitted = s.sched[N_RUNNING]
        batcher.admit(s, sh)
        t = lap(s, t, P_ADMIT)
        bucket = batcher.plan(s, sh)
        t = lap(s, t, P_PLAN)
        publish(s, sh, first_admitted)
        if tid == 0:
            publish_stats(s, sh, bucket >= 0)
        cuda.syncthreads()
        lap(s, t, P_PUBLISH)
        return bucket

    return iterate


