"""The waiting queue (``waiting.py``: collect, enqueue, cancel_queued) under the CUDA simulator, alone, against
``references.WaitingQueue``.

Each round plays one iteration's part: the agent side writes new READY requests and cancel words straight into a
ring; the kernel runs ``cancel_queued`` when a cancel was written and ``collect`` + ``enqueue`` when a request was
submitted (or on a rescan), as settle does on its doorbells; then the queue, the ``seq_seen`` marks, the refused
slots and the counters are compared with the reference. Between rounds the test does what the other phases would:
admission pops the queue's head, the previous round's refusals are published and their slots freed, admitted
requests finish and free their slots, which the agent reuses with a new epoch (a stale cancel word stays behind).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device import references as ref
from tests.device.phases import launch, save_counters, scheduler_arrays

from blink.config import load_policy
from blink.device.config import SchedulerConfig
from blink.device.numba_compat import cuda
from blink.device.scheduler import scratch
from blink.device.policy import by_priority, fcfs
from blink.device.state import COUNT, MAX_CANDIDATES, N_COUNTERS, PENALTY_NAMES
from blink.device.waiting import cancel_queued, collect, enqueue
from blink.ring.geometry import RingGeometry
from blink.ring.layout import FREE, READY, RUNNING

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=6, max_output_tokens=5, max_stop_ids=2, logprobs=False)
CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, page_size=4, num_pages=4, max_model_len=8,
                         enable_prefix_caching=False)
LIMITS = ref.Limits(GEOMETRY.max_prompt_tokens, GEOMETRY.max_output_tokens, GEOMETRY.max_stop_ids,
                    CONFIG.max_model_len)


def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
    return prompt_len


POLICIES = {                        # name -> (device policy, reference key)
    "fcfs": (fcfs, ref.fcfs_key),
    "by_priority": (by_priority, ref.by_priority_key),
    "shortest_prompt_first": (load_policy(shortest_prompt_first), lambda r: r.prompt_len),
}
_kernels = {}


def waiting_kernel(policy):
    """cancel_queued (phases[0]) then collect + enqueue (phases[1]), refusals counted as settle counts them."""
    if policy not in _kernels:
        @cuda.jit
        def kernel(s, phases, counters):
            sh = scratch()
            if phases[0] != 0:
                cancel_queued(s, sh)
            if phases[1] != 0:
                enqueue(s, sh, collect(s, sh, policy))
            if cuda.threadIdx.x == 0:
                s.sched[0].pending_finished += sh.counters[COUNT.refused]
            save_counters(sh, counters)

        _kernels[policy] = kernel
    return _kernels[policy]


class Ring:
    """A ring written directly (header fields as the agent would write them, any value the field can hold), the
    device state and the reference, side by side."""

    def __init__(self, policy="fcfs", threads=2, geometry=GEOMETRY, config=CONFIG, limits=LIMITS):
        self.view, self.s = scheduler_arrays(geometry, config)
        device_policy, key = POLICIES[policy] if isinstance(policy, str) else policy
        self.kernel = waiting_kernel(device_policy)
        self.threads = threads
        self.reference = ref.WaitingQueue(limits, key)
        self.counters = np.zeros(N_COUNTERS, np.int32)
        self.running: list[int] = []

    def submit(self, slot, prompt_len=2, max_tokens=2, n_stop=0, arrival_ns=0, priority=0, request_id=1,
               extra=(0, 1.0, 1.0, 0, 0)):
        """Header and prompt, a new epoch, READY. ``n_generated`` / ``finish_reason`` keep the last occupant's
        values (garbage the scheduler must overwrite when it refuses)."""
        view = self.view
        assert view.status["state"][slot] == FREE
        h = view.headers
        top_k, temperature, top_p, flags, seed = extra
        for name, value in dict(prompt_len=prompt_len, max_tokens=max_tokens, n_stop=n_stop, arrival_ns=arrival_ns,
                                priority=priority, request_id=request_id, top_k=top_k, temperature=temperature,
                                top_p=top_p, request_flags=flags, seed=seed).items():
            h[name][slot] = value
        view.stop_token_ids[slot] = [100 + slot, 200 + slot][:GEOMETRY.max_stop_ids]
        for k, name in enumerate(PENALTY_NAMES):            # distinct per slot and field
            h[name][slot] = 0.125 * (slot + 1) + k
        view.prompts[slot] = np.arange(view.prompts.shape[1]) + 10 * slot
        view.status["epoch"][slot] += 1
        view.status["n_generated"][slot] = 5
        view.status["finish_reason"][slot] = 2
        view.status["state"][slot] = READY

    def cancel(self, slot, stale=False):
        epoch = int(self.view.status["epoch"][slot])
        self.view.status["cancel"][slot] = epoch + 7 if stale else epoch

    def iterate(self, cancels: bool, scan: bool):
        """One iteration's waiting-queue phases on the device and in the reference; compare everything."""
        before = int(self.s.sched[0].pending_finished)
        launch(self.kernel, self.threads, self.s, np.array([int(cancels), int(scan)], np.int32), self.counters)
        ring = ref.read_ring(self.view)
        counts = dict(new=0, refused=0, cancelled=0)
        for phase, run in ((self.reference.cancel_queued, cancels), (self.reference.scan, scan)):
            if run:
                for name, value in phase(ring).items():
                    counts[name] += value
        self.check(counts)
        return before

    def check(self, counts):
        s, r = self.s, self.reference
        head, count = int(s.sched[0].queue_head), int(s.sched[0].queued)
        assert 0 <= head and head + count <= len(s.queue_slots)
        queue = list(zip(s.queue_keys[head:head + count].tolist(), s.queue_slots[head:head + count].tolist()))
        assert queue == r.queue
        assert s.seq_seen.tolist() == [r.seen.get(slot, 0) for slot in range(len(s.seq_seen))]
        pending = s.pending_finished[:s.sched[0].pending_finished].tolist()
        assert sorted(pending) == sorted(r.pending), "refused slots (each exactly once)"
        for slot, reason in r.pending.items():
            assert (s.finish[slot], s.ngen[slot]) == (reason, 0)
        for slot, request in r.loaded.items():      # the header copy of every queued request
            if r.seen.get(slot) != ref.QUEUED:
                continue
            h = self.view.headers[slot]
            assert (s.seq_prompt_len[slot], s.seq_max_tokens[slot], s.seq_n_stop[slot]) == \
                (request.prompt_len, request.max_tokens, request.n_stop)
            assert (s.seq_top_k[slot], s.seq_flags[slot], s.seq_seed[slot]) == \
                (h["top_k"], h["request_flags"], np.uint64(h["seed"]).astype(np.int64))
            assert (s.seq_temperature[slot], s.seq_top_p[slot]) == (h["temperature"], h["top_p"])
            assert s.seq_penalties[slot].tolist() == [h[name] for name in PENALTY_NAMES]
            stops = self.view.stop_token_ids[slot, :request.n_stop]
            assert s.seq_stop[slot, :request.n_stop].tolist() == stops.tolist()
        c = self.counters
        assert (c[COUNT.new], c[COUNT.refused], c[COUNT.finished], c[COUNT.cancelled]) == \
            (counts["new"], counts["refused"], counts["refused"], counts["cancelled"])

    # What the rest of the scheduler (admit, publish) and the agent do between iterations.

    def admit(self, k):
        """Admission takes the first ``k`` queued requests (start_sequence clears the mark; publish: RUNNING)."""
        s = self.s
        head, count = int(s.sched[0].queue_head), int(s.sched[0].queued)
        k = min(k, count)
        taken = s.queue_slots[head:head + k].tolist()
        for slot in taken:
            s.seq_seen[slot] = 0
            self.view.status["state"][slot] = RUNNING
        s.sched[0].queue_head, s.sched[0].queued = head + k, count - k
        assert self.reference.pop(k) == taken
        self.running += taken

    def publish(self, publishable):
        """FINISHED for the first ``publishable`` refused slots (an iteration after their refusal); the agent frees
        them at once. Returns the refused slots still pending."""
        s = self.s
        pending = s.pending_finished[:s.sched[0].pending_finished].tolist()
        published, waiting = pending[:publishable], pending[publishable:]
        for slot in published:
            s.seq_seen[slot] = 0
            self.view.status["state"][slot] = FREE
        s.pending_finished[:len(waiting)] = waiting
        s.sched[0].pending_finished = len(waiting)
        self.reference.publish(published)

    def finish_running(self):
        for slot in self.running:
            self.view.status["state"][slot] = FREE
        self.running = []

    def free_slots(self):
        return [slot for slot in range(len(self.s.state)) if self.view.status["state"][slot] == FREE]


# -- random rounds --------------------------------------------------------------------------------------------------

request = st.fixed_dictionaries(dict(
    prompt_len=st.sampled_from([1, 2, 3, 4, 5, 6, 1, 2, 3, 1, 2, 3, 0, 7, 2**32 - 1]),
    max_tokens=st.sampled_from([1, 2, 3, 4, 5, 1, 2, 1, 2, 0, 6]),
    n_stop=st.sampled_from([0, 0, 0, 1, 2, 3]),
    arrival_ns=st.integers(0, 5),                    # ties: the slot decides
    priority=st.sampled_from([0, 1, -1, 2, 2**31 - 1, -2**31]),
    extra=st.tuples(st.integers(0, 50), st.sampled_from([0.0, 0.7, 1.0]), st.sampled_from([0.5, 1.0]),
                    st.integers(0, 3), st.integers(0, 2**64 - 1)),
))
round_ = st.fixed_dictionaries(dict(
    submits=st.lists(st.tuples(request, st.integers(0, 7)), max_size=6),     # (request, which free slot)
    cancels=st.lists(st.tuples(st.integers(0, 7), st.booleans()), max_size=3),   # (which slot in use, stale)
    rescan=st.booleans(),
    admit=st.integers(0, 3),
))


@settings(max_examples=80, deadline=None)
@given(rounds=st.lists(round_, min_size=1, max_size=6), policy=st.sampled_from(sorted(POLICIES)),
       threads=st.sampled_from([1, 3, 4]), first_id=st.sampled_from([1, 2**40 - 2]))
def test_random_submit_and_cancel_rounds_match_the_reference(rounds, policy, threads, first_id):
    ring = Ring(policy, threads)
    next_id = first_id
    for r in rounds:
        for spec, pick in r["submits"]:
            free = ring.free_slots()
            if free:
                ring.submit(free[pick % len(free)], request_id=next_id, **spec)
                next_id += 1
        in_use = [slot for slot in range(GEOMETRY.n_slots) if slot not in ring.free_slots()]
        cancels = [(in_use[i % len(in_use)], stale) for i, stale in r["cancels"]] if in_use else []
        for slot, stale in cancels:
            ring.cancel(slot, stale)
        publishable = ring.iterate(cancels=bool(cancels), scan=bool(r["submits"]) or r["rescan"])
        ring.finish_running()
        ring.admit(r["admit"])
        ring.publish(publishable)


# -- named cases ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, ok", [
    ("prompt_len", 1, True), ("prompt_len", 6, True), ("prompt_len", 0, False), ("prompt_len", 7, False),
    ("prompt_len", 2**32 - 1, False),                       # -1 as the device reads the u32 word
    ("max_tokens", 1, True), ("max_tokens", 0, False), ("max_tokens", 6, False),
    ("n_stop", 2, True), ("n_stop", 3, False), ("n_stop", 2**32 - 1, False),
])
def test_each_geometry_limit_of_servable(field, value, ok):
    ring = Ring()
    ring.submit(3, **{"prompt_len": 2, "max_tokens": 2, field: value})
    ring.iterate(cancels=False, scan=True)
    assert ring.s.seq_seen[3] == (ref.QUEUED if ok else ref.REFUSED)


@pytest.mark.parametrize("prompt_len, max_tokens, ok", [(6, 2, True), (3, 5, True), (6, 3, False), (4, 5, False)])
def test_prompt_and_output_must_fit_max_model_len(prompt_len, max_tokens, ok):
    ring = Ring()
    ring.submit(0, prompt_len=prompt_len, max_tokens=max_tokens)
    ring.iterate(cancels=False, scan=True)
    assert ring.s.seq_seen[0] == (ref.QUEUED if ok else ref.REFUSED)


def test_ties_go_in_slot_order_and_merge_into_an_offset_queue():
    ring = Ring(threads=3)
    for slot, arrival in ((5, 1), (1, 7), (3, 7)):
        ring.submit(slot, arrival_ns=arrival)
    ring.iterate(cancels=False, scan=True)
    ring.admit(1)                                   # slot 5 leaves: the queue starts at head 1, after a key of 1
    for slot, arrival in ((0, 7), (2, 3), (4, 9)):
        ring.submit(slot, arrival_ns=arrival)
    ring.iterate(cancels=False, scan=True)
    assert ring.reference.queue == [(3, 2), (7, 0), (7, 1), (7, 3), (9, 4)]


def test_cancel_removes_exactly_the_cancelled_entries_in_order():
    ring = Ring(threads=4)
    for slot in range(6):
        ring.submit(slot, arrival_ns=10 - slot)
    ring.iterate(cancels=False, scan=True)
    ring.admit(1)                                   # slot 5 leaves; head 1
    for slot in (4, 1):
        ring.cancel(slot)
    ring.cancel(2, stale=True)                      # the cancel word of another epoch cancels nothing
    ring.iterate(cancels=True, scan=False)
    assert ring.reference.queue == [(7, 3), (8, 2), (10, 0)]
    assert sorted(ring.reference.pending) == [1, 4]


def test_a_stale_cancel_word_does_not_cancel_the_slots_next_request():
    ring = Ring()
    ring.submit(2)
    ring.iterate(cancels=False, scan=True)
    ring.admit(1)
    ring.cancel(2)                                  # cancels the running request (not the queue's business)
    ring.iterate(cancels=True, scan=False)
    ring.finish_running()
    ring.submit(2, arrival_ns=4)                    # the slot's next request: new epoch, old cancel word
    ring.iterate(cancels=False, scan=True)
    assert ring.reference.queue == [(4, 2)] and not ring.reference.pending


def test_a_request_cancelled_before_its_scan_is_refused_by_the_scan():
    ring = Ring()
    ring.submit(0)
    ring.submit(1, max_tokens=0)
    ring.cancel(0)
    ring.cancel(1)
    ring.iterate(cancels=True, scan=True)           # both doorbells moved: cancel_queued, then collect
    assert ring.reference.pending == {0: ref.FINISH_ABORT, 1: ref.FINISH_ABORT}   # cancelled wins over unservable


def test_refused_slots_are_not_taken_again_before_they_are_published():
    ring = Ring()
    ring.submit(0, prompt_len=0)
    ring.submit(1)
    ring.iterate(cancels=False, scan=True)
    ring.cancel(1)
    publishable = ring.iterate(cancels=True, scan=False)
    ring.submit(2)
    ring.iterate(cancels=False, scan=True)          # a rescan with slots 0 and 1 still READY in the ring
    assert sorted(ring.reference.pending) == [0, 1]
    ring.publish(publishable + 1)
    assert ring.reference.pending == {} and ring.s.seq_seen[:2].tolist() == [0, 0]


def test_requests_written_by_the_agent():
    """Real requests (Agent.submit / cancel through LocalMemory), by priority."""
    from blink.nic.agent import Agent
    from blink.ring.layout import RingLayout
    from blink.ring.request import SamplingParams
    from blink.ring.transport import LocalMemory

    from blink.device.arrays import ring_arrays

    layout = RingLayout(GEOMETRY)
    memory = LocalMemory(layout.size)
    memory.write(0, layout.control_bytes())
    agent = Agent(memory, GEOMETRY)
    ring = Ring("by_priority", threads=2)
    ring.view = layout.view(memory.buffer)          # the device reads the agent's ring
    ring.s = ring.s._replace(**ring_arrays(ring.view))
    ids = [agent.submit([1] * n, SamplingParams(max_tokens=2, stop_token_ids=(9,) * (n % 3)), priority=p)
           for n, p in [(1, 3), (2, -1), (3, 3), (4, 0), (5, -1)]]
    agent.submit([1, 2], SamplingParams(max_tokens=5, seed=1))      # 2 + 5 <= 8: servable
    agent.submit([1, 2, 3, 4], SamplingParams(max_tokens=5))        # 4 + 5 > max_model_len 8: error
    ring.iterate(cancels=False, scan=True)
    assert [slot for _, slot in ring.reference.queue] == [1, 4, 3, 5, 0, 2]
    agent.cancel(ids[3])
    ring.iterate(cancels=True, scan=False)
    assert [slot for _, slot in ring.reference.queue] == [1, 4, 5, 0, 2]
    assert ring.reference.pending == {6: ref.FINISH_ERROR, 3: ref.FINISH_ABORT}
    del ring
    memory.close()


def test_a_policy_may_return_the_largest_int64_key():
    """Regression: a policy key is any int64 (policy.py). With three new candidates, one keyed INT64_MAX,
    ``sort_pairs`` padded its four-entry network with (INT64_MAX, -1), which ordered before (INT64_MAX, 0):
    ``enqueue`` then merged the first three, queueing slot -1 and dropping slot 0, which stayed marked QUEUED (no
    scan took it again) and was never admitted. Padding now sorts after every real pair."""

    def last_if_flagged(arrival_ns, prompt_len, max_tokens, priority, request_id):
        return 9223372036854775807 if priority > 0 else arrival_ns

    key = lambda r: (1 << 63) - 1 if r.priority > 0 else r.arrival_ns  # noqa: E731
    ring = Ring((load_policy(last_if_flagged), key))
    ring.submit(0, priority=1)
    ring.submit(1, arrival_ns=5)
    ring.submit(2, arrival_ns=6)
    ring.iterate(cancels=False, scan=True)          # compares the queue with [(5, 1), (6, 2), (INT64_MAX, 0)]


def test_a_burst_larger_than_one_scan_is_queued_over_two_scans():
    """More READY requests than MAX_CANDIDATES: a scan queues MAX_CANDIDATES of them (which ones is not specified),
    asks for another scan (``seen_submitted = -1``), and the next scan queues the rest. Refusals are not capped."""
    n = MAX_CANDIDATES + 40                         # 11 of them refused: 1053 servable
    geometry = RingGeometry(n_slots=n, max_prompt_tokens=6, max_output_tokens=5, max_stop_ids=2, logprobs=False)
    ring = Ring(threads=4, geometry=geometry)
    refused = set(range(0, n, 97))
    for slot in range(n):
        ring.submit(slot, prompt_len=0 if slot in refused else 2, arrival_ns=(slot * 7919) % 64)
    launch(ring.kernel, ring.threads, ring.s, np.array([0, 1], np.int32), ring.counters)
    s = ring.s
    queued = s.queue_slots[:s.sched[0].queued].tolist()
    assert len(queued) == MAX_CANDIDATES and s.stats[0].seen_submitted == -1
    keys = s.queue_keys[:len(queued)].tolist()
    assert list(zip(keys, queued)) == sorted(zip(keys, queued))
    assert keys == [(slot * 7919) % 64 for slot in queued]
    assert sorted(np.flatnonzero(s.seq_seen == ref.QUEUED).tolist()) == sorted(queued)
    assert set(np.flatnonzero(s.seq_seen == ref.REFUSED).tolist()) == refused
    assert sorted(s.pending_finished[:s.sched[0].pending_finished].tolist()) == sorted(refused)
    ring.reference.scan(ref.read_ring(ring.view))   # the reference: one scan of everything
    launch(ring.kernel, ring.threads, ring.s, np.array([0, 1], np.int32), ring.counters)
    queue = list(zip(s.queue_keys[:s.sched[0].queued].tolist(), s.queue_slots[:s.sched[0].queued].tolist()))
    assert queue == ring.reference.queue and len(queue) == n - len(refused)
