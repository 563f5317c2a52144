"""The GPU-resident scheduler: one iteration of the persistent loop, written as block-wide device functions.

An iteration has two parts, run by one thread block. **prepare** (PREPARE) needs the step that just ran, and writes
the next:

1. a shutdown that settle saw (``sched.shutdown``): abort everything in flight (``shut_down``), return ``STOP``;
2. **consume** the previous step's sampled tokens: token (and logprob) into the ring's output area; the request's
   grammar state moves on (``grammar.after``); stop checks (EOS unless ignore_eos, stop ids -> "stop";
   ``max_tokens`` -> "length"); the pages the step filled enter the prefix cache (``prefix.cache_step``);
3. **retire** finished and cancelled sequences (the cancel words are read only when settle saw the ``cancels``
   doorbell move): their pages released (``kv.free_sequences``), ``finish_reason``;
4. **admit** from the waiting queue's head (``batcher.admit``), 5. **plan** the next step's inputs
   (``batcher.plan``, profiled in three phases: chunks, pages, inputs); return the bucket to launch, or ``IDLE``.

**settle** needs nothing from the running step and writes nothing it reads (no step buffer), in two halves:

6. PUBLISH: **publish** prepare's ring writes after one fence (``publish.py``): ``n_generated``, RUNNING for its
   admissions, FINISHED for the requests that finished an iteration earlier; then heartbeat, counters and gauges
   into the control block;
7. COLLECT: read the **doorbells** (shutdown, ``submitted``, ``cancels``; three words across PCIe, three warps), then
   **collect**: drop cancelled requests from the waiting queue (when ``cancels`` moved), take new READY requests
   into it (``waiting.py``, when ``submitted`` moved), for the next prepare to admit. Returns ``AGAIN`` when the
   next iteration has work without a doorbell moving (requests queued, finished ones to publish, a shutdown).

The resident loop (shim.cu) calls PREPARE, launches the step, then SETTLE (PUBLISH then COLLECT as one part, the
doorbells' loads issued before publish's fence, so one PCIe round trip covers both) while the step runs. When an
iteration had nothing to run and left no work, it stays resident and calls WATCH (the doorbells read, nothing written:
AGAIN once one moved) until a doorbell moves or its idle sleep has passed, then iterates again. The tail
loop and the simulator call COLLECT, PREPARE, PUBLISH at once (``ITERATION``: the flags run in that order), then the
step: the same cycle of phases with the step between settle's halves instead of beside them, so what COLLECT takes
in (a request, a cancel, a shutdown) is acted on before the next step is planned, as the resident loop does with
what arrived before its last doorbell read. What one part leaves another goes through the scheduler's state
(``s.sched[0]``: ``admitted``, ``shutdown``, ``cancel_bell``; each part's counts through the device counters,
``fold_counts``), never through shared memory, which each part zeroes where it starts. All state lives in global
memory (``SchedulerArrays``) and nothing is kept between launches, so the same code runs as a relaunched GPU kernel
and as a simulator kernel. The agent writes only the ring: words it may change are read with ``load_volatile``;
counters live in device memory and are only stored to the ring (no read across PCIe).
"""
from __future__ import annotations

from numba import int32, int64

from blink.device import batcher, consume, prefix
from blink.device.block import MAX_THREADS, exclusive_scan
from blink.device.doorbells import load_doorbells, moved, note_doorbells
from blink.device.kv import free_sequences
from blink.device.numba_compat import clock, cuda, inlined, load_volatile
from blink.device.profile import add_laps, lap
from blink.device.publish import fold_counts, publish, publish_stats
from blink.device.state import (AGAIN, COLLECT, COUNT, IDLE, MAX_CANDIDATES, N_COUNTERS, N_PHASES, PHASE, PREPARE,
                                PUBLISH, REFUSED, SETTLE, STOP, WATCH, Scratch)
from blink.device.waiting import cancel_queued, cancelled, collect, enqueue
from blink.ring.control import ENGINE_SERVING, ENGINE_STOPPED
from blink.ring.layout import FINISH_ABORT, FINISH_NONE, FINISHED, READY


@cuda.jit(device=True)
def retire(s, sh):
    """Finish sequences that stopped (``consume`` counted them) or were cancelled (their cancel words read only when a
    settle saw the ``cancels`` doorbell move since the last retire); free their pages; compact the running list in
    order. Nothing to do, it returns before any load of the running list."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    bell = s.sched[0].cancel_bell
    if bell == 0 and sh.counters[COUNT.stopped] == 0:
        return                               # only consume's stops and cancels finish a running sequence
    n = s.sched[0].running
    pending = s.sched[0].pending_finished    # read before a barrier: thread 0 rewrites it at the end
    # rank[i]: finishing flag -> finishing sequences before i (a kept sequence moves to i - rank[i]).
    for i in range(tid, n, nt):
        slot = s.running[i]
        reason = s.seq_finish[slot]
        if reason == FINISH_NONE and bell != 0 and cancelled(s, slot):
            reason = FINISH_ABORT
            s.seq_finish[slot] = reason
        sh.rank[i] = 1 if reason != FINISH_NONE else 0
        if reason != FINISH_NONE:
            cuda.atomic.add(sh.counters, COUNT.ending, 1)
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].cancel_bell = 0           # acted on
    if sh.counters[COUNT.ending] == 0:           # the common case: one barrier, no scans
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
    free_sequences(s, sh, sh.slots, n_finishing)
    for i in range(tid, n_finishing, nt):
        slot = sh.slots[i]
        reason = s.seq_finish[slot]
        s.seq_finish[slot] = FINISH_NONE
        s.finish[slot] = reason                   # FINISHED follows in the next iteration's publish
        s.pending_finished[pending + i] = slot
        cuda.atomic.add(sh.counters, COUNT.finished, 1)
        if reason == FINISH_ABORT:
            cuda.atomic.add(sh.counters, COUNT.cancelled, 1)
    for i in range(tid, n_kept, nt):
        s.running[i] = sh.kept[i]
    if tid == 0:
        s.sched[0].running = n_kept
        s.sched[0].pending_finished = pending + n_finishing
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
    n = s.sched[0].running
    pending = s.sched[0].pending_finished
    for i in range(tid, n, nt):
        sh.slots[i] = s.running[i]
    cuda.syncthreads()
    free_sequences(s, sh, sh.slots, n)
    for i in range(tid, n, nt):
        slot = sh.slots[i]
        s.seq_finish[slot] = FINISH_NONE
        s.finish[slot] = FINISH_ABORT
        s.queue_tmp_slots[i] = slot
        cuda.atomic.add(sh.counters, COUNT.finished, 1)
        cuda.atomic.add(sh.counters, COUNT.cancelled, 1)
    for i in range(tid, pending, nt):
        s.queue_tmp_slots[n + i] = s.pending_finished[i]
    for slot in range(tid, s.state.shape[0], nt):
        if load_volatile(s.state, slot) == READY and s.seq_seen[slot] != REFUSED:   # refused: in pending already
            s.ngen[slot] = 0
            s.finish[slot] = FINISH_ABORT
            s.queue_tmp_slots[n + pending + cuda.atomic.add(sh.counters, COUNT.refused, 1)] = slot
            cuda.atomic.add(sh.counters, COUNT.finished, 1)
            cuda.atomic.add(sh.counters, COUNT.cancelled, 1)
    cuda.syncthreads()
    if tid == 0:
        fold_counts(s, sh)
        publish_stats(s)
    cuda.threadfence_system()
    cuda.syncthreads()
    for i in range(tid, n + pending + sh.counters[COUNT.refused], nt):
        slot = s.queue_tmp_slots[i]
        s.seq_seen[slot] = 0
        s.state[slot] = FINISHED
    cuda.syncthreads()
    if tid == 0:
        s.sched[0].running = 0
        s.sched[0].rows = 0
        s.sched[0].queued = 0
        s.sched[0].queue_head = 0
        s.sched[0].pending_finished = 0
        s.sched[0].publishable = 0
        cuda.threadfence_system()
        s.control[0].engine_state = ENGINE_STOPPED


@cuda.jit(device=True)
def scratch():
    """The iteration's shared-memory work arrays (``Scratch``), its counters zeroed. All threads, where each part of
    the iteration starts (the parts share the arrays: one call site of each)."""
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
    cycles = cuda.shared.array(N_PHASES, int64)
    for k in range(cuda.threadIdx.x, N_COUNTERS, cuda.blockDim.x):
        counters[k] = 0
    cuda.syncthreads()
    return Scratch(slots, keys, rank, pages, tokens, chunk, kept, partial, counters, cycles)


def make_iterate(policy):
    """Build the iteration device function with ``policy`` (see ``blink.device.policy``) ordering admission.

    ``iterate(s, part)`` runs the parts of an iteration that ``part`` names (flags, run in this order): COLLECT
    (settle's second half; returns AGAIN or IDLE), PREPARE (returns the bucket to launch, IDLE or STOP), PUBLISH
    (settle's first half), SETTLE (both halves as one: AGAIN or IDLE), WATCH (alone: AGAIN when a doorbell moved,
    else IDLE; nothing written); with PREPARE, it returns prepare's outcome.
    ``s`` is the ``SchedulerArrays``: the arrays themselves (the simulator), or the GPU image's table of their
    addresses (``array_table.py``).
    """

    @cuda.jit(device=True)
    def prepare(s, sh):
        """Act on a shutdown settle saw; take the finished step's tokens; retire; admit; plan the next step."""
        tid = cuda.threadIdx.x
        t = clock()
        shutdown = s.sched[0].shutdown
        rows = s.sched[0].rows                  # with the word before it: one round trip
        if shutdown != 0:                       # seen by a settle: no step of ours runs now
            shut_down(s, sh)
            return STOP
        if tid == 0:
            s.sched[0].consumed = rows
        consume.consume(s, sh, rows)
        prefix.cache_step(s, sh)
        t = lap(sh, t, PHASE.consume)
        retire(s, sh)
        t = lap(sh, t, PHASE.retire)
        batcher.admit(s, sh)
        t = lap(sh, t, PHASE.admit)
        bucket = batcher.plan(s, sh, t)         # laps its own phases: chunks, pages, inputs
        if tid == 0:
            s.stats[0].steps += 1 if bucket >= 0 else 0
            fold_counts(s, sh)
            add_laps(s, sh, PHASE.consume, PHASE.inputs + 1)
        cuda.syncthreads()                      # the counters are read before the next part zeroes them
        return bucket

    @cuda.jit(device=True)
    def settle_publish(s, sh):
        """Publish prepare's ring writes, then heartbeat, counters and gauges."""
        t = clock()
        publish(s, sh)
        if cuda.threadIdx.x == 0:
            s.stats[0].heartbeat += 1
            s.control[0].engine_state = ENGINE_SERVING
            publish_stats(s)
            lap(sh, t, PHASE.publish)
            add_laps(s, sh, PHASE.publish, PHASE.publish + 1)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def settle_collect(s, sh, bells):
        """Act on the doorbells ``bells`` (``load_doorbells``); drop cancelled queued requests, queue new ones. AGAIN
        when the next iteration has work of its own (requests queued, finished requests to publish, a shutdown to
        act on), else IDLE."""
        t = clock()
        shutdown, submitted, cancels = bells
        note_doorbells(s, sh, shutdown, submitted, cancels)
        t = lap(sh, t, PHASE.doorbells)
        if sh.counters[COUNT.cancel_bell] != 0:
            cancel_queued(s, sh)
        n_new = 0
        if sh.counters[COUNT.scan] != 0:
            n_new = collect(s, sh, policy)
        t = lap(sh, t, PHASE.collect)
        enqueue(s, sh, n_new)
        if cuda.threadIdx.x == 0:               # refused READY requests are published like finished ones
            s.sched[0].pending_finished += sh.counters[COUNT.refused]
            fold_counts(s, sh)
            lap(sh, t, PHASE.enqueue)
            add_laps(s, sh, PHASE.doorbells, PHASE.enqueue + 1)
        cuda.syncthreads()
        if sh.counters[COUNT.new] != 0 or s.sched[0].pending_finished != 0 or s.sched[0].shutdown != 0:
            return AGAIN
        return IDLE

    @cuda.jit(device=True)
    def settle(s, sh):
        """The resident loop's settle, PUBLISH then COLLECT as one part: the doorbells' loads go out first, so
        publish's fence (a PCIe round trip) also waits out theirs."""
        bells = load_doorbells(s)
        settle_publish(s, sh)
        return settle_collect(s, sh, bells)

    @inlined                                # into the image's entry: a call would save and restore registers
    def iterate(s, part):
        outcome = IDLE
        if part & COLLECT:
            outcome = settle_collect(s, scratch(), load_doorbells(s))
        if part & PREPARE:
            outcome = prepare(s, scratch())
            if outcome == STOP:
                return STOP
        if part & PUBLISH:
            settle_publish(s, scratch())
        if part & SETTLE:
            outcome = settle(s, scratch())
        if part & WATCH:
            outcome = AGAIN if moved(s, scratch(), load_doorbells(s)) else IDLE
        return outcome

    return iterate
