"""Admission and step planning (``batcher.py``: admit, plan) under the CUDA simulator, alone, against
``references.Batcher``.

A state is built by hand in both (running sequences with their prompt, generated tokens, computed tokens and block
tables; a shuffled free stack; a waiting queue at some head offset); the kernel runs ``admit`` then ``plan``, as
``iterate`` does; every word they leave is compared with the reference: the running list and queue words, chunks,
preemptions, pages and block tables per slot, the free stack, and the step's inputs (rows, token ids, positions,
slot mapping, block-table rows, logits indices, bucket), which must also satisfy ``step.py``'s contract
(``check_step_contract``). A step is then consumed in Python (chunks computed, a token sampled where a row reached
its end) and the next iteration planned, so block-table rows are also checked when only their new entries are
copied.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device import references as ref
from tests.device.phases import GARBAGE, fill_step_buffers, launch, save_counters, scheduler_arrays
from tests.device.test_scheduler import check_step_contract

from blink.device.batcher import admit, plan
from blink.device.config import SchedulerConfig
from blink.device.mirror import KVMirror
from blink.device.numba_compat import clock, cuda
from blink.device.scheduler import scratch
from blink.device.state import COUNT, IDLE, N_COUNTERS, QUEUED
from blink.ring.geometry import RingGeometry
from blink.ring.layout import READY, RUNNING

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=12, max_output_tokens=8, max_stop_ids=0, logprobs=False)
MAX_MODEL_LEN = 16


@cuda.jit
def batcher_kernel(s, phases, counters, result):
    """admit (phases[0]) then plan (phases[1]); the bucket (or IDLE) in result[0]."""
    sh = scratch()
    if phases[0] != 0:
        admit(s, sh)
    bucket = IDLE
    if phases[1] != 0:
        bucket = plan(s, sh, clock())
    if cuda.threadIdx.x == 0:
        result[0] = bucket
    save_counters(sh, counters)


def prompt_of(slot, length):
    return [1000 + 100 * slot + k for k in range(length)]


def sampled_token(slot, n):
    return 5000 + 100 * slot + n


class Batch:
    """One hand-built scheduler state, on the device and in the reference.

    ``running``: ``(slot, prompt_len, n_generated, computed)`` in admission order; each holds the pages of its
    computed tokens, taken from ``free`` (the free stack, top last; default ``range(num_pages)``) in KVMirror order.
    ``queue``: ``(slot, prompt_len)`` from the head, placed at ``head`` in the queue arrays.
    """

    def __init__(self, config, running=(), queue=(), free=None, head=0, threads=3):
        self.config, self.threads = config, threads
        self.view, self.s = scheduler_arrays(GEOMETRY, config)
        s = self.s
        kv = KVMirror(config.num_pages)
        if free is not None:
            kv.free = list(free)
        self.ref = ref.Batcher(config.page_size, config.max_num_batched_tokens, config.max_num_seqs,
                               config.watermark_pages, config.buckets, kv)
        for slot, prompt_len, n_generated, computed in running:
            seq = ref.Sequence(prompt_of(slot, prompt_len), [sampled_token(slot, k) for k in range(n_generated)],
                               computed)
            assert 0 <= computed < seq.total, "after consume, a running sequence has a token left to compute"
            kv.allocate([slot], [ref.pages_for(computed, config.page_size)])
            self.ref.seqs[slot] = seq
            self.ref.running.append(slot)
            s.seq_prompt_len[slot], s.seq_total[slot], s.seq_computed[slot] = prompt_len, seq.total, computed
            s.outputs[slot, :n_generated] = seq.generated
            s.seq_last[slot] = seq.generated[-1] if n_generated else -9
            self.view.status["state"][slot] = RUNNING
        for slot, prompt_len in queue:
            self.ref.seqs[slot] = ref.Sequence(prompt_of(slot, prompt_len))
            self.ref.queue.append(slot)
            s.seq_prompt_len[slot] = prompt_len
            s.seq_total[slot] = s.seq_computed[slot] = s.seq_npages[slot] = -3    # admission sets them
            s.seq_seen[slot], s.ngen[slot], s.finish[slot] = QUEUED, 5, 2
            self.view.status["state"][slot] = READY
        for slot, seq in self.ref.seqs.items():
            s.prompts[slot, :len(seq.prompt)] = seq.prompt
            s.seq_version[slot] = 1                  # each admitted once: versions alone do not tell slots apart
            s.seq_seed[slot], s.seq_temperature[slot], s.seq_top_p[slot], s.seq_top_k[slot] = \
                77 + slot, 0.25 * slot, 1 - 0.0625 * slot, slot
            s.seq_penalties[slot] = (0.5 * slot, -0.25 * slot, 1 + 0.125 * slot)
        self.load_pages()
        fill_step_buffers(s, persistent=True)       # row_slot is -1: every row is written whole
        s.running[:len(running)] = self.ref.running
        s.sched[0].running = len(running)
        s.queue_slots[head:head + len(queue)] = self.ref.queue
        s.sched[0].queue_head, s.sched[0].queued = head, len(queue)
        self.counters = np.zeros(N_COUNTERS, np.int32)
        self.result = np.zeros(1, np.int32)

    def load_pages(self):
        """The reference's pages into the device arrays (free stack: garbage above the top)."""
        s, kv = self.s, self.ref.kv
        s.free_pages[:] = -5
        s.free_pages[:len(kv.free)] = kv.free
        s.sched[0].free_top = len(kv.free)
        s.page_ref[:] = kv.ref
        for slot in self.ref.seqs:
            table = kv.tables.get(slot, [])
            s.seq_npages[slot] = len(table)
            s.seq_pages[slot, :len(table)] = table

    def iterate(self, phases=(1, 1)):
        """admit + plan on the device and in the reference; compare; return (admitted, step) of the reference."""
        s, r = self.s, self.ref
        versions = s.seq_version.copy()
        states = self.view.status["state"].copy()
        head = int(s.sched[0].queue_head)
        fill_step_buffers(s)
        launch(batcher_kernel, self.threads, s, np.array(phases, np.int32), self.counters, self.result)
        admitted = r.admit() if phases[0] else []
        step = r.plan() if phases[1] else None
        # Admission.
        assert self.counters[COUNT.admitted] == len(admitted)
        assert s.running[:s.sched[0].running].tolist() == r.running
        assert (s.sched[0].queue_head, s.sched[0].queued) == (head + len(admitted), len(r.queue))
        assert s.queue_slots[s.sched[0].queue_head:s.sched[0].queue_head + len(r.queue)].tolist() == r.queue
        for slot in admitted:
            assert (s.seq_seen[slot], s.ngen[slot], s.finish[slot]) == (0, 0, 0)
        assert (self.view.status["state"] == states).all(), "admission publishes nothing (publish does)"
        # Preemption, pages, computed tokens.
        assert self.counters[COUNT.preempted] == len(r.preempted)
        bumped = (s.seq_version - versions).tolist()
        assert bumped == [int(slot in admitted) + r.preempted.count(slot) for slot in range(len(bumped))]
        assert s.free_pages[:s.sched[0].free_top].tolist() == r.kv.free
        for slot in r.running:
            seq = r.seqs[slot]
            assert (s.seq_total[slot], s.seq_computed[slot]) == (seq.total, seq.computed), slot
            assert s.seq_pages[slot, :s.seq_npages[slot]].tolist() == r.pages(slot), slot
        # The step.
        if step is None:
            assert self.result[0] == IDLE and s.sched[0].rows == 0
            return admitted, None
        assert self.result[0] == step.bucket
        n_rows, n_tokens = len(step.rows), len(step.positions)
        assert (s.num_seqs[0], s.sched[0].rows) == (n_rows, n_rows)
        assert s.row_slot[:n_rows].tolist() == [slot for slot, _, _ in step.rows]
        starts = np.cumsum([0] + [chunk for _, _, chunk in step.rows]).tolist()
        assert s.query_start_loc[:n_rows + 1].tolist() == starts
        assert s.seq_lens[:n_rows].tolist() == [first + chunk for _, first, chunk in step.rows]
        assert s.logits_indices[:n_rows].tolist() == step.logits_indices
        assert s.token_ids[:n_tokens].tolist() == step.token_ids
        assert s.positions[:n_tokens].tolist() == step.positions
        assert s.slot_mapping[:n_tokens].tolist() == step.slot_mapping
        page = self.config.page_size
        for row, (slot, first, chunk) in enumerate(step.rows):
            n_pages = ref.pages_for(first + chunk, page)
            assert s.block_tables[row, :n_pages].tolist() == r.pages(slot)[:n_pages], (row, slot)
            assert (s.top_k[row], s.top_p[row]) == (s.seq_top_k[slot], s.seq_top_p[slot])
            assert (s.penalties[row] == s.seq_penalties[slot]).all() and s.prompt_lens[row] == s.seq_prompt_len[slot]
        check_step_contract(s, self.config, step.bucket)
        return admitted, step

    def consume(self, step):
        """What the next iteration's consume does with the step (a token for every row that reached its end)."""
        s = self.s
        sampled = {}
        for slot, first, chunk in step.rows:
            seq = self.ref.seqs[slot]
            s.seq_computed[slot] += chunk
            if first + chunk == seq.total:
                token = sampled[slot] = sampled_token(slot, len(seq.generated))
                s.outputs[slot, s.seq_total[slot] - s.seq_prompt_len[slot]] = token
                s.seq_total[slot] += 1
                s.seq_last[slot] = token
        self.ref.consume(step, sampled)

    def room_for(self, steps):
        """Whether ``steps`` more steps keep every sequence within max_model_len."""
        return all(seq.total + steps <= MAX_MODEL_LEN for seq in self.ref.seqs.values())


def config(page_size=2, num_pages=8, watermark=0, max_num_seqs=4, budget=8, buckets=(1, 2, 4, 8)):
    """The batcher alone: ``references.Batcher`` does not cache prefixes (test_prefix.py and test_scheduler.py do)."""
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, page_size=page_size,
                           num_pages=num_pages, max_model_len=MAX_MODEL_LEN, buckets=buckets,
                           watermark_pages=watermark, enable_prefix_caching=False)


# -- random states --------------------------------------------------------------------------------------------------


@st.composite
def states(draw, tight=False):
    """(config, running, queue, free stack, queue head); ``tight``: several sequences and no page to spare."""
    page_size = draw(st.sampled_from([2, 4]))
    max_num_seqs = draw(st.integers(3 if tight else 1, 4))
    budget = draw(st.integers(max_num_seqs, 12))
    buckets = sorted(set(draw(st.lists(st.integers(1, budget), max_size=3))) | {budget})
    if draw(st.booleans()):
        buckets.append(budget + 4)              # a bucket larger than the budget: never chosen
    watermark = draw(st.integers(0, 2))
    slots = draw(st.permutations(range(GEOMETRY.n_slots)))
    n_running = draw(st.integers(max_num_seqs - 1 if tight else 0, max_num_seqs))
    running = []
    for slot in slots[:n_running]:
        prompt_len = draw(st.integers(4 if tight else 1, 10))
        n_generated = draw(st.integers(0, 3))
        total = prompt_len + n_generated
        computed = draw(st.integers(0, total - 1) | st.just(total - 1))      # often a decode
        running.append((slot, prompt_len, n_generated, computed))
    n_queued = draw(st.integers(0 if n_running else 1, 3))
    queue = [(slot, draw(st.integers(1, 12))) for slot in slots[n_running:n_running + n_queued]]
    head = draw(st.integers(0, GEOMETRY.n_slots - len(queue)))
    # Few pages beyond those held (each running sequence holds the pages of what it computed): preemptions.
    held = sum(ref.pages_for(computed, page_size) for *_, computed in running)
    num_pages = max(MAX_MODEL_LEN // page_size + watermark, held + draw(st.integers(0, 1 if tight else 3)))
    free = draw(st.permutations(range(num_pages)))
    cfg = config(page_size, num_pages, watermark, max_num_seqs, budget, tuple(buckets))
    return cfg, running, queue, free, head


def plan_steps(state, threads, steps):
    """Plan ``steps`` iterations from ``state``, consuming each step, all compared with the reference."""
    cfg, running, queue, free, head = state
    batch = Batch(cfg, running, queue, free, head, threads)
    for left in range(steps, 0, -1):
        _, step = batch.iterate()
        if step is None or not batch.room_for(left):
            break
        batch.consume(step)


@settings(max_examples=100, deadline=None)
@given(state=states(), threads=st.sampled_from([1, 2, 3, 4]), steps=st.integers(1, 3))
def test_random_states_match_the_reference(state, threads, steps):
    plan_steps(state, threads, steps)


@settings(max_examples=40, deadline=None)
@given(state=states(tight=True), threads=st.sampled_from([1, 2, 3, 4]), steps=st.integers(1, 3))
def test_random_states_under_page_pressure_match_the_reference(state, threads, steps):
    plan_steps(state, threads, steps)


@settings(max_examples=20, deadline=None)
@given(state=states(), threads=st.sampled_from([1, 3]))
def test_admit_alone_and_plan_alone(state, threads):
    cfg, running, queue, free, head = state
    batch = Batch(cfg, running, queue, free, head, threads)
    batch.iterate(phases=(1, 0))
    batch.iterate(phases=(0, 1))


# -- named cases ----------------------------------------------------------------------------------------------------


def test_no_free_pages_a_decode_preempts_the_newest_page_holder():
    batch = Batch(config(num_pages=8), running=[(0, 4, 1, 4), (1, 12, 1, 12)])   # 2 + 6 pages: none free
    _, step = batch.iterate()                  # both decodes need a third / seventh page
    assert batch.ref.preempted == [1]
    assert step.rows == [(0, 4, 1), (1, 0, 7)]  # 1 decode + 7 of the re-prefill (budget 8), 1 + 4 pages
    assert len(batch.ref.kv.free) == 1


def test_a_sequence_preempted_in_its_row_gets_its_whole_new_block_table():
    """Step 1 copies both rows' tables; in step 2 slot 1 keeps row 1 but was preempted (new version, new pages):
    the row must be copied again from its first entry, not only past the entries of its previous version."""
    batch = Batch(config(num_pages=8), running=[(0, 3, 1, 3), (1, 11, 0, 10)])   # 2 + 5 pages held, 1 free
    _, step = batch.iterate()
    assert step.rows == [(0, 3, 1), (1, 10, 1)] and not batch.ref.preempted
    batch.consume(step)
    _, step = batch.iterate()                  # slot 0 needs a page, none free: slot 1 (6 pages) is preempted
    assert batch.ref.preempted == [1] and step.rows == [(0, 4, 1), (1, 0, 7)]


def test_no_free_pages_and_no_decode_the_newest_holder_is_preempted_for_progress():
    """Regression (test_scheduler): prefills whose pages are full, none free, no decode to force a preemption."""
    batch = Batch(config(num_pages=8), running=[(0, 10, 0, 8), (1, 12, 0, 8)])    # 4 + 4 full pages
    _, step = batch.iterate()
    assert batch.ref.preempted == [1]
    assert step.rows == [(0, 8, 2), (1, 0, 6)]


def test_no_free_pages_and_nothing_to_preempt_plans_nothing():
    batch = Batch(config(num_pages=8), running=[(0, 3, 0, 0)], free=[])  # pages vanished (as in test_scheduler)
    _, step = batch.iterate()
    assert step is None and batch.result[0] == IDLE


def test_nothing_running_plans_nothing():
    batch = Batch(config())
    _, step = batch.iterate()
    assert step is None and batch.result[0] == IDLE


def test_all_decode_rows_follow_the_running_order_and_pad_to_the_bucket():
    batch = Batch(config(), running=[(5, 3, 1, 3), (2, 2, 2, 3), (7, 1, 1, 1)])
    _, step = batch.iterate()
    assert step.rows == [(5, 3, 1), (2, 3, 1), (7, 1, 1)] and step.bucket == 2     # 3 tokens: bucket 4
    assert batch.s.slot_mapping[3] == -1 and batch.s.token_ids[3] == 0 and batch.s.positions[3] == 0
    batch.consume(step)
    _, step = batch.iterate()                  # again, copying only new block-table entries
    assert [chunk for _, _, chunk in step.rows] == [1, 1, 1]


def test_the_last_sampled_token_is_read_from_device_memory():
    """``seq_last``, not the ring's output area (host memory, across PCIe), holds the token a decode feeds back;
    earlier outputs (a re-prefill after preemption) come from the ring."""
    batch = Batch(config(), running=[(0, 3, 2, 4), (1, 2, 3, 0)])
    batch.s.outputs[0, 1] = batch.s.outputs[1, 2] = -7     # last outputs: not to be read
    _, step = batch.iterate()
    assert step.token_ids == [sampled_token(0, 1)] + prompt_of(1, 2) + [sampled_token(1, k) for k in range(3)]


def test_a_prefill_cut_to_one_token_by_the_budget():
    batch = Batch(config(budget=4, buckets=(4,)), running=[(0, 2, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2), (3, 9, 0, 0)])
    _, step = batch.iterate()
    assert step.rows[-1] == (3, 0, 1) and step.logits_indices[-1] == -1


def test_a_prefill_cut_to_one_token_by_the_pages():
    """Every page held: the prefill has one position left in its last page, the decode needs no new page."""
    batch = Batch(config(page_size=4, num_pages=4), running=[(0, 8, 0, 3), (1, 9, 1, 9)])
    _, step = batch.iterate()
    assert step.rows == [(0, 3, 1), (1, 9, 1)] and not batch.ref.preempted


def test_pages_a_decode_holds_beyond_its_next_token_are_not_lent_to_a_prefill():
    """A decode that holds pages past its next token (speculation's rejected drafts leave them) needs no new page;
    its spare page is not free: the prefill beside it gets the 4 free pages (8 tokens), not 5. Counting the spare
    page as negative need let the prefill take a fifth page off the top of an empty free stack."""
    batch = Batch(config(num_pages=8, budget=12, buckets=(4, 8, 16)), running=[(0, 4, 1, 4), (1, 12, 0, 0)])
    batch.ref.kv.allocate([0], [2])             # positions 4..7: one page for the decode, one spare
    batch.load_pages()
    _, step = batch.iterate()
    assert step.rows == [(0, 4, 1), (1, 0, 8)] and not batch.ref.preempted and not batch.ref.kv.free


def test_a_decodes_spare_page_does_not_stand_in_for_another_decodes_new_page():
    """No free page; slot 0's decode holds a spare one (as above), slot 1's decode needs a new one: slot 1 is
    preempted, as without the spare page, rather than taking a page off the top of an empty free stack."""
    batch = Batch(config(num_pages=8), running=[(0, 4, 1, 4), (1, 8, 1, 8)])
    batch.ref.kv.allocate([0], [2])
    batch.load_pages()
    _, step = batch.iterate()
    assert batch.ref.preempted == [1] and step.rows == [(0, 4, 1), (1, 0, 7)]


def test_a_long_prefill_is_chunked_over_steps_and_samples_once():
    batch = Batch(config(budget=4, buckets=(1, 2, 4)), queue=[(3, 11)])
    chunks = []
    while True:
        _, step = batch.iterate()
        chunks.append([chunk for _, _, chunk in step.rows])
        if step.logits_indices[0] >= 0:
            break
        batch.consume(step)
    assert chunks == [[4], [4], [3]]


@pytest.mark.parametrize("watermark, admitted", [(2, [1]), (1, [1, 4]), (0, [1, 4, 6])])
def test_the_watermark_and_the_first_misfit_block_admission(watermark, admitted):
    """5 free pages, prompts of 2, 2 and 1 pages. Above a watermark of 2 only the first fits, and the third, which
    would fit alone, waits behind the second; above 1 the first two fit exactly; with none all three do."""
    batch = Batch(config(num_pages=11, watermark=watermark), running=[(0, 12, 1, 12)],
                  queue=[(1, 4), (4, 3), (6, 2)], head=2)
    assert len(batch.ref.kv.free) == 5
    got, _ = batch.iterate(phases=(1, 0))
    assert got == admitted
    batch.iterate(phases=(0, 1))


def test_admission_stops_at_max_num_seqs():
    batch = Batch(config(max_num_seqs=2), running=[(0, 2, 0, 0)], queue=[(1, 1), (2, 1)])
    got, step = batch.iterate()
    assert got == [1] and batch.ref.queue == [2] and [slot for slot, _, _ in step.rows] == [0, 1]


def test_the_smallest_bucket_that_holds_the_tokens():
    buckets = (1, 2, 4, 8, 12)
    for tokens, bucket in [(1, 0), (2, 1), (3, 2), (5, 3), (8, 3), (9, 4)]:
        batch = Batch(config(budget=12, buckets=buckets), queue=[(0, tokens)])
        _, step = batch.iterate()
        assert step.bucket == bucket
        assert (batch.s.slot_mapping[tokens:buckets[bucket]] == -1).all()
        assert (batch.s.slot_mapping[buckets[bucket]:] == GARBAGE).all(), "nothing written past the bucket"
