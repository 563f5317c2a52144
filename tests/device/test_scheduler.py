"""The scheduler iteration (device code under the CUDA simulator) driven through the ring by a real Agent.

References: outputs must equal the stand-in model's continuation cut by the reference consumer's stop rules; every
planned step's inputs must satisfy ``step.py``'s contract, checked here in plain Python against the ring's tokens
(its drafts too: prompt lookup's over them, while the scheduler reads them from the steps' token history);
after every iteration the pages satisfy ``pages.check_pages``; and a model of the KV pool (``KVContents``: which
token prefix each pool cell holds the K/V of) checks that every step reads, through its block tables, exactly the
K/V of its own tokens: no page is freed, evicted or overwritten while a sequence reads it, a prefix cache hit is
the same tokens. Prefix caching is on (as by default) unless a test turns it off.
"""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device.pages import check_pages
from tests.device.references import prompt_lookup

from blink.device.config import SchedulerConfig, SpeculativeConfig
from blink.device.sim import SimScheduler
from blink.device.state import AGAIN, IDLE, PREPARE, PUBLISHED_COUNTERS, QUEUED, REFUSED, SETTLE, STOP, WATCH
from blink.device.step import StepBuffers, StepLayout
from blink.errors import RingFull
from blink.nic.agent import Agent
from blink.ring.control import ENGINE_STOPPED
from blink.ring.geometry import RingGeometry
from blink.ring.grammar import PLACEMENT_WORDS, build, next_state, start_state
from blink.ring.hashing import reference_keys
from blink.ring.layout import FLAG_GRAMMAR, HEADER_DTYPE, RingLayout
from blink.ring.reference import expected_output
from blink.ring.request import SamplingParams
from blink.ring.standin import STANDIN_VOCAB, standin_continuation, standin_step
from blink.ring.transport import LocalMemory
from tests.grammars import random_grammar

GEOMETRY = RingGeometry(n_slots=12, max_prompt_tokens=40, max_output_tokens=12, max_stop_ids=2, prefix_page_size=4,
                        max_logit_bias=3, max_top_logprobs=2, max_grammar_bytes=1 << 20, vocab_size=STANDIN_VOCAB)
CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=24, max_model_len=52,
                         buckets=(1, 2, 4, 8, 16), eos_token_ids=(), block_threads=4)
# Grammars some requests follow: the stand-in model does not obey them, but the scheduler must walk them.
GRAMMARS = [random_grammar(np.random.default_rng(k), STANDIN_VOCAB, (7, 11), most=200)[0] for k in range(3)]


def without_caching(config=CONFIG, geometry=GEOMETRY):
    """The same scheduler and ring with prefix caching off (and no prompt keys in the ring)."""
    return (SchedulerConfig(**{**config.__dict__, "enable_prefix_caching": False}),
            RingGeometry(**{**geometry.__dict__, "prefix_page_size": 0}))


def free_pages(s) -> int:
    return int(s.sched[0].free_top + s.sched[0].evictable)


def tokens_of(s, slot) -> list[int]:
    """Every token the request in ``slot`` has: its prompt, its outputs, the last sampled one from device memory,
    then the drafts the planned step verifies after it (speculative decoding; none otherwise)."""
    prompt_len, total = int(s.seq_prompt_len[slot]), int(s.seq_total[slot])
    known = list(s.prompts[slot, :prompt_len]) + list(s.outputs[slot, :total - prompt_len])
    if total > prompt_len:
        known[total - 1] = int(s.seq_last[slot])
    return [int(t) for t in known + list(s.seq_draft[slot, :s.seq_ndraft[slot]])]


class KVContents:
    """Which token prefix each cell of the KV pool holds the K/V of, as the planned steps write it: a step's query
    token at ``position`` writes its cell (``slot_mapping``) with the sequence's tokens up to it; every position
    before the query, read through the block table, must hold the reader's own prefix."""

    def __init__(self):
        self.cells: dict[int, tuple[int, ...]] = {}

    def step(self, s, page_size):
        for r in range(int(s.num_seqs[0])):
            slot, length = int(s.row_slot[r]), int(s.seq_lens[r])
            first = length - int(s.query_start_loc[r + 1] - s.query_start_loc[r])
            tokens = tokens_of(s, slot)
            for position in range(first):
                cell = int(s.block_tables[r, position // page_size]) * page_size + position % page_size
                assert self.cells.get(cell) == tuple(tokens[:position + 1]), \
                    f"slot {slot} reads position {position} from cell {cell}, which holds other K/V"
            for k, position in enumerate(range(first, length)):
                self.cells[int(s.slot_mapping[int(s.query_start_loc[r]) + k])] = tuple(tokens[:position + 1])


class Harness:
    """A ring in local memory, an Agent, and the simulated scheduler; checks every step it plans and the pages
    after every iteration. ``window``: each iteration in the GPU's resident loop's order (prepare, the step, then
    settle: publish and collect, which run beside the step there), each settle checked to write no step buffer."""

    def __init__(self, config=CONFIG, geometry=GEOMETRY, threads=4, policy=None, vocab_size=STANDIN_VOCAB,
                 window=False):
        self.layout = RingLayout(geometry)
        self.memory = LocalMemory(self.layout.size)
        self.memory.write(0, self.layout.control_bytes())
        self.agent = Agent(self.memory, geometry)
        self.config = config
        self.step = StepBuffers(StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq,
                                           geometry.max_logit_bias, geometry.max_top_logprobs))
        options = {} if policy is None else {"policy": policy}
        self.kv = KVContents()
        self.scheduler = SimScheduler(self.layout.view(self.memory.buffer), geometry, config, self.step,
                                      step_fn=self.run_step, threads=threads, **options)
        self.outputs: dict[int, list[int]] = {}
        self.top: dict[int, list] = {}
        self.reasons: dict[int, str] = {}
        self.steps: list[dict] = []
        self.vocab_size = vocab_size
        self.window = window

    def iterate(self) -> int:
        if self.window:
            outcome = self.scheduler.iteration(PREPARE)
            if outcome != STOP:
                settled = self.settle_beside_the_step()
                outcome = settled if outcome == IDLE else outcome
        else:
            outcome = self.scheduler.iteration()
        running = int(self.scheduler.arrays.sched[0].running)
        assert outcome >= 0 or running == 0, f"no step planned while {running} sequences run: no progress"
        s = self.scheduler.arrays
        check_pages(s, s.running[:s.sched[0].running].tolist())
        if outcome >= 0:
            self.steps.append(check_step_contract(s, self.config, outcome))
        self.poll()
        return outcome

    def settle_beside_the_step(self) -> int:
        """Settle alone (publish, then collect), as the resident loop runs it while the step runs: it must write
        none of the step's buffers (inputs the step reads, outputs it writes). Returns collect's AGAIN or IDLE."""
        before = {name: tensor.numpy().copy() for name, tensor in self.step.tensors().items()}
        settled = self.scheduler.iteration(SETTLE)
        for name, tensor in self.step.tensors().items():
            assert np.array_equal(tensor.numpy(), before[name]), f"settle wrote the step's {name}"
        return settled

    def poll(self) -> None:
        for out in self.agent.poll():
            assert out.request_id not in self.reasons, "output after the request finished"
            self.outputs.setdefault(out.request_id, []).extend(out.new_tokens)
            self.top.setdefault(out.request_id, []).extend(out.new_top_logprobs or [])
            if out.finished:
                self.reasons[out.request_id] = out.finish_reason

    def run_step(self, arrays, bucket_tokens):
        self.kv.step(arrays, self.config.page_size)
        standin_step(arrays, bucket_tokens, self.vocab_size)
        standin_top(arrays)

    def run_until_idle(self, limit=400):
        for _ in range(limit):
            if self.iterate() == IDLE and not self.agent.in_flight:
                return
        raise AssertionError(f"not idle after {limit} iterations; in flight: {self.agent.in_flight}")


def standin_top(s):
    """Top logprobs for the stand-in's sampled rows: the token and its two successors, at its logprob, -1, -2."""
    for r in range(s.sampled_top_ids.shape[0]):
        for j in range(s.sampled_top_ids.shape[1]):
            s.sampled_top_ids[r, j] = s.sampled_ids[r] + j
            s.sampled_top_logprobs[r, j] = s.sampled_logprobs[r] - j


def check_step_contract(s, config, bucket):
    """Every invariant step.py promises, for the step just planned; returns a summary of the step."""
    tokens_in_bucket = config.buckets[bucket]
    n_rows = int(s.num_seqs[0])
    qsl = s.query_start_loc
    n_tokens = int(qsl[n_rows])
    assert 0 < n_tokens <= min(tokens_in_bucket, config.max_num_batched_tokens)
    assert bucket == 0 or config.buckets[bucket - 1] < n_tokens, "not the smallest bucket"
    assert int(qsl[0]) == 0 and (np.diff(qsl[:n_rows + 1]) > 0).all()
    rows_in_bucket = min(tokens_in_bucket, len(s.logits_indices))
    assert (qsl[n_rows:rows_in_bucket + 1] == n_tokens).all() and (s.seq_lens[n_rows:rows_in_bucket] == 0).all()
    assert (s.logits_indices[n_rows:rows_in_bucket] == -1).all()
    assert (s.slot_mapping[n_tokens:tokens_in_bucket] == -1).all()
    page = config.page_size
    slots = s.row_slot[:n_rows].tolist()
    drafts = s.row_draft[:n_rows].tolist()      # j > 0: the row verifies draft j of the slot of the row before
    assert len({slot for slot, j in zip(slots, drafts) if j == 0}) == drafts.count(0), "a sequence in two groups"
    # Attention's view: each group (a row and the draft rows after it) one chunk in its first row, the others empty.
    aqsl, alens = s.attn_query_start_loc, s.attn_seq_lens
    assert (aqsl[n_rows:rows_in_bucket + 1] == n_tokens).all() and (alens[n_rows:rows_in_bucket] == 0).all()
    for first in (r for r in range(n_rows) if drafts[r] == 0):
        end = next((r for r in range(first + 1, n_rows) if drafts[r] == 0), n_rows)
        assert aqsl[first] == qsl[first] and alens[first] == s.seq_lens[end - 1]
        assert (aqsl[first + 1:end] == qsl[end]).all() and (alens[first + 1:end] == 0).all()
    chunks = []
    for r, slot in enumerate(slots):
        q = int(qsl[r + 1] - qsl[r])
        length = int(s.seq_lens[r])
        j = drafts[r]
        assert j == 0 or (slots[r - 1] == slot and drafts[r - 1] == j - 1 and q == 1), "a draft row out of place"
        assert j <= int(s.seq_ndraft[slot])
        total = int(s.seq_total[slot]) + j
        assert length <= total
        known = tokens_of(s, slot)
        if j == 0 and s.seq_ndraft[slot] > 0:      # the drafts: prompt lookup's over the tokens the ring holds
            total, spec = int(s.seq_total[slot]), config.speculative
            assert known[total:] == prompt_lookup(known[:total], len(known) - total, spec.prompt_lookup_min,
                                                  spec.prompt_lookup_max)
        for k in range(q):
            t = int(qsl[r]) + k
            position = length - q + k
            assert s.positions[t] == position and s.token_ids[t] == known[position]
            table_page = s.block_tables[r, position // page]
            assert table_page == s.seq_pages[slot, position // page]
            assert s.slot_mapping[t] == table_page * page + position % page
        n_pages = -(-length // page)
        assert (s.block_tables[r, :n_pages] == s.seq_pages[slot, :n_pages]).all()
        assert s.logits_indices[r] == (int(qsl[r + 1]) - 1 if length == total else -1)
        assert s.seed[r] == s.seq_seed[slot] and s.temperature[r] == s.seq_temperature[slot]
        # The request's min_p and logit_bias, as the agent wrote them into the ring, whoever held the row before.
        header = s.headers[slot]
        n_bias = int(header.n_logit_bias)
        assert s.min_p[r] == header.min_p and s.n_logit_bias[r] == n_bias
        assert (s.logit_bias_ids[r, :n_bias] == s.bias_i32[slot, 0:2 * n_bias:2]).all()
        assert (s.logit_bias[r, :n_bias] == s.bias_f32[slot, 1:2 * n_bias:2]).all()
        # Its grammar state: its placement's start state moved by each token generated so far (none: -1), walked
        # in the ring; the step reads the mirror, which holds the placement as the ring does.
        state = start_state(s.grammars, int(header.grammar)) if header.request_flags & FLAG_GRAMMAR else -1
        for token in known[int(s.seq_prompt_len[slot]):total] if state >= 0 else ():
            state = next_state(s.grammars, state, token, STANDIN_VOCAB)
        assert s.grammar_state[r] == state
        if state >= 0:
            placement = slice(int(header.grammar), int(header.grammar) + int(s.grammars[int(header.grammar)]))
            assert (s.grammar_mirror[placement] == s.grammars[placement]).all()
        chunks.append(q)
    return {"slots": slots, "chunks": chunks}


request = st.tuples(st.lists(st.integers(0, 31999), min_size=1, max_size=40), st.integers(1, 12),
                    st.integers(0, 2**64 - 1), st.booleans(), st.integers(0, 6), st.booleans())


@settings(max_examples=8, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=9), num_pages=st.sampled_from([13, 18, 40]),
       threads=st.sampled_from([1, 4]), use_stop=st.booleans(), window=st.booleans())
def test_random_workloads_match_the_reference(requests, num_pages, threads, use_stop, window):
    """Staggered arrivals, chunked prefill (16-token budget), preemption (tight page pools), cancellations; in the
    tail loop's order and in the resident loop's (where no settle may write a step buffer)."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": num_pages, "eos_token_ids": (7, 11)})
    run_workload(Harness(config, threads=threads, window=window), requests, use_stop)


# Tokens of a small vocabulary repeat, in prompts and in the stand-in's outputs: prompt lookup finds drafts, and the
# stand-in (a hash of the previous token and the position) confirms about one in SMALL_VOCAB.
SMALL_VOCAB = 6
repeating = st.tuples(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=1, max_size=40), st.integers(1, 12),
                      st.integers(0, 2**64 - 1), st.booleans(), st.integers(0, 6), st.booleans())
SPECULATIVE = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


# 40 examples of up to 9 requests in the tightest pools: 8 examples of up to 6 never found a decode's spare page
# (a rejected draft's) lent to another decode (kv.pages_short); these found it in each of 3 runs.
@settings(max_examples=40, deadline=None)
@given(requests=st.lists(repeating, min_size=1, max_size=9), num_pages=st.sampled_from([13, 14, 40]),
       threads=st.sampled_from([1, 4]), use_stop=st.booleans())
def test_random_workloads_with_speculation_match_the_reference(requests, num_pages, threads, use_stop):
    """The same, drafts proposed and verified: the outputs are the reference's (the stand-in decides every token, so
    a wrong draft kept would show), every draft row keeps step.py's contract, and the KV model sees no rejected
    draft's K/V read."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": num_pages, "eos_token_ids": (7, 11),
                                "speculative": SPECULATIVE})
    stats = run_workload(Harness(config, threads=threads, vocab_size=SMALL_VOCAB), requests, use_stop, SMALL_VOCAB)
    assert stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"] <= 3 * stats["spec_drafts"]
    kept = stats["spec_accepted_per_pos"]       # a step that kept draft j + 1 kept draft j
    assert sum(kept) == stats["spec_accepted_tokens"] and list(kept) == sorted(kept, reverse=True)
    assert kept[0] <= stats["spec_drafts"] and not any(kept[3:]), "3 drafts at most"


def test_speculation_accepts_drafts_the_model_confirms():
    """One copy-prone request alone: drafts are verified and some accepted, in fewer steps than tokens; the tokens a
    step kept extend the sequence's prefix-key chain one after another, as the agent hashes the same tokens."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "speculative": SPECULATIVE})
    h = Harness(config, vocab_size=2)
    prompt = [0, 1] * 6
    rid = h.agent.submit(prompt, SamplingParams(max_tokens=12, seed=5, ignore_eos=True))
    h.run_until_idle()
    assert (h.outputs[rid], h.reasons[rid]) == expected_output(prompt, SamplingParams(
        max_tokens=12, seed=5, ignore_eos=True), vocab_size=2)
    stats = h.agent.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["steps"] < 1 + 12
    s = h.scheduler.arrays
    (slot,) = np.flatnonzero(s.seq_total == len(prompt) + 12)
    keys, state = reference_keys(prompt + h.outputs[rid], GEOMETRY.prefix_page_size, int(s.stats[0].prefix_seed))
    assert int(s.seq_hash[slot]) == state
    assert s.seq_keys[slot, len(prompt) // GEOMETRY.prefix_page_size:len(keys)].tolist() == \
        keys[len(prompt) // GEOMETRY.prefix_page_size:], "the generated pages' keys"


def test_the_tokens_a_step_kept_move_its_grammar_one_after_another():
    """A copy-prone request under a grammar whose state moves on with every token: where a step kept drafts, each
    kept token moves the state the token before it left (every later step's rows are checked against the ring's
    walk of the grammar, ``check_step_contract``)."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "speculative": SPECULATIVE, "eos_token_ids": (7, 11)})
    h = Harness(config, vocab_size=2)
    counting = {k: {0: k + 1, 1: k + 1} for k in range(12)}      # state k: k tokens generated
    grammar = build(("regex", "twelve tokens"), STANDIN_VOCAB, 0, counting, [12], (7, 11))
    prompt, params = [0, 1] * 6, SamplingParams(max_tokens=12, seed=5, grammar=grammar)
    rid = h.agent.submit(prompt, params)
    h.run_until_idle()
    assert (h.outputs[rid], h.reasons[rid]) == expected_output(prompt, params, (7, 11), vocab_size=2)
    assert h.agent.stats()["spec_accepted_tokens"] > 0


def test_drafts_that_do_not_all_fit_the_rows_left_are_cut_not_dropped():
    """Two rows a step, one decoding sequence whose every token occurs in its prompt (so each lookup finds drafts,
    often three): every step after the prefill that may draft verifies the one draft that fits."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "max_num_seqs": 2, "speculative": SPECULATIVE})
    h = Harness(config, vocab_size=SMALL_VOCAB)
    params = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    prompt = list(range(SMALL_VOCAB)) * 2
    rid = h.agent.submit(prompt, params)
    h.run_until_idle()
    assert (h.outputs[rid], h.reasons[rid]) == expected_output(prompt, params, vocab_size=SMALL_VOCAB)
    stats = h.agent.stats()
    assert stats["spec_draft_tokens"] == stats["spec_drafts"] >= stats["steps"] - 2, stats   # the prefill, the last


@pytest.mark.parametrize("disable_by_batch_size", [2, 3])
def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(disable_by_batch_size):
    """Three copy-prone requests that decode together from the first step to the last (prompts of 5 tokens, all
    prefilled in the first step's 16, and the same max_tokens): with ``disable_by_batch_size`` 2 no step drafts, with
    3 they do; the tokens are the reference's."""
    spec = replace(SPECULATIVE, disable_by_batch_size=disable_by_batch_size)
    h = Harness(SchedulerConfig(**{**CONFIG.__dict__, "speculative": spec}), vocab_size=SMALL_VOCAB)
    params = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    prompts = [[0, 1, 2, 3, 4], [5, 4, 3, 2, 1], [0, 1, 0, 1, 2]]
    rids = [h.agent.submit(prompt, params) for prompt in prompts]
    h.run_until_idle()
    for rid, prompt in zip(rids, prompts):
        assert (h.outputs[rid], h.reasons[rid]) == expected_output(prompt, params, vocab_size=SMALL_VOCAB)
    drafts = h.agent.stats()["spec_drafts"]
    assert drafts == 0 if disable_by_batch_size == 2 else drafts > 0, drafts


@pytest.mark.parametrize("cap", [0, 1, None])
def test_a_request_caps_or_refuses_its_own_drafts(cap):
    """``num_speculative_tokens`` per request: 0 verifies no draft, 1 one per step, None the server's three; the
    tokens are the reference's every time. Every token of the output occurs in the prompt: every lookup finds some."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "speculative": SPECULATIVE})
    h = Harness(config, vocab_size=SMALL_VOCAB)
    params = SamplingParams(max_tokens=12, seed=5, ignore_eos=True, num_speculative_tokens=cap)
    prompt = list(range(SMALL_VOCAB)) * 2
    rid = h.agent.submit(prompt, params)
    h.run_until_idle()
    assert (h.outputs[rid], h.reasons[rid]) == expected_output(prompt, params, vocab_size=SMALL_VOCAB)
    stats = h.agent.stats()
    most = SPECULATIVE.num_speculative_tokens if cap is None else cap
    assert stats["spec_drafts"] <= stats["spec_draft_tokens"] <= most * stats["spec_drafts"]
    assert (stats["spec_drafts"] > 0) == (cap != 0), stats
    if cap is None:
        assert stats["spec_draft_tokens"] > stats["spec_drafts"], "some steps verified more than one draft"


def test_a_decode_drafts_in_a_step_that_also_prefills():
    """A copy-prone request decoding while another's 40-token prompt is prefilled in chunks, in the smallest pool
    the config allows: the steps that carry a prefill chunk also verify the decode's drafts, and both outputs are the
    reference's. The pool runs out (a preemption) while the decode holds pages its rejected drafts were written to:
    check_pages and the pool model see every page held once (test_batcher.py pins the count of such pages)."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": 13, "speculative": SPECULATIVE})
    h = Harness(config, vocab_size=SMALL_VOCAB)
    copying = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    first = h.agent.submit(list(range(SMALL_VOCAB)) * 2, copying)
    for _ in range(4):                          # the prefill, then decodes that draft
        h.iterate()
    long_prompt = [(7 * k) % SMALL_VOCAB for k in range(40)]
    second = h.agent.submit(long_prompt, SamplingParams(max_tokens=4, seed=6, ignore_eos=True))
    h.run_until_idle()
    assert (h.outputs[first], h.reasons[first]) == expected_output(list(range(SMALL_VOCAB)) * 2, copying,
                                                                  vocab_size=SMALL_VOCAB)
    assert (h.outputs[second], h.reasons[second]) == expected_output(
        long_prompt, SamplingParams(max_tokens=4, seed=6, ignore_eos=True), vocab_size=SMALL_VOCAB)
    mixed = [step for step in h.steps if max(step["chunks"]) > 1
             and any(a == b for a, b in zip(step["slots"], step["slots"][1:]))]   # a chunk, and a draft row
    assert mixed, [(step["slots"], step["chunks"]) for step in h.steps]
    assert h.agent.stats()["preempted"] > 0


def run_workload(h, requests, use_stop, vocab_size=STANDIN_VOCAB) -> dict:
    """Submit ``requests`` (prompt, max_tokens, seed, ignore_eos, arrival iteration, cancel) to ``h`` as they
    arrive, cancel some two iterations later, run until idle; every output must be the reference's. Returns the
    ring's stats."""
    config = h.config
    submitted, cancelled = {}, set()
    schedule = sorted(enumerate(requests), key=lambda item: item[1][4])
    for iteration in range(400):
        for index, (prompt, max_tokens, seed, ignore_eos, arrival, cancel) in schedule:
            if arrival == iteration:
                stop = (standin_continuation(prompt, seed, max_tokens, vocab_size)[max_tokens // 2],) if use_stop \
                    else ()
                params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos,
                                        stop_token_ids=stop, min_p=seed % 5 / 4,
                                        logit_bias={(seed >> 8 * k) % 32000: k - 1.5 for k in range(seed % 4)},
                                        grammar=None if ignore_eos else GRAMMARS[seed % 4] if seed % 4 < 3 else None)
                rid = h.agent.submit(prompt, params)
                submitted[rid] = (prompt, params, cancel)
            elif arrival + 2 == iteration and cancel:
                rid = next(r for r, (p, _, _) in submitted.items() if p is prompt)
                if h.agent.cancel(rid):
                    cancelled.add(rid)
        if h.iterate() == IDLE and not h.agent.in_flight and iteration > 8:
            break
    assert len(h.reasons) == len(requests)
    num_pages = config.num_pages
    for rid, (prompt, params, _) in submitted.items():
        tokens, reason = expected_output(prompt, params, config.eos_token_ids, vocab_size)
        if rid in cancelled and h.reasons[rid] == "abort":
            assert h.outputs.get(rid, []) == tokens[:len(h.outputs.get(rid, []))]
        else:
            assert (h.outputs.get(rid, []), h.reasons[rid]) == (tokens, reason)
    s = h.scheduler.arrays
    assert free_pages(s) == num_pages and int(s.sched[0].running) == 0
    stats = h.agent.stats()
    assert stats["admitted"] + stats["cancelled"] >= len(requests) == stats["finished"]
    assert stats["tokens"] == sum(len(v) for v in h.outputs.values())
    assert stats["kv_pages_free"] == num_pages and stats["running"] == 0
    # publish_stats stores every device counter into the ring's field of the same name
    assert {name: stats[name] for name in PUBLISHED_COUNTERS} == {
        name: int(s.stats[0][name]) for name in PUBLISHED_COUNTERS}
    return stats


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_sampled_once():
    h = Harness()
    prompt = list(range(100, 140))
    rid = h.agent.submit(prompt, SamplingParams(max_tokens=3, seed=5))
    h.run_until_idle()
    assert [step["chunks"] for step in h.steps] == [[16], [16], [8], [1], [1]]
    assert h.outputs[rid] == standin_continuation(prompt, 5, 3) and h.reasons[rid] == "length"


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget():
    h = Harness()
    first = h.agent.submit([1, 2, 3], SamplingParams(max_tokens=6, seed=1))
    h.iterate()                                            # prefill of `first` (3 tokens)
    second = h.agent.submit(list(range(30)), SamplingParams(max_tokens=2, seed=2))
    h.iterate()
    assert h.steps[-1] == {"slots": [0, 1], "chunks": [1, 15]}
    h.run_until_idle()
    assert h.outputs[first] == standin_continuation([1, 2, 3], 1, 6)
    assert h.outputs[second] == standin_continuation(list(range(30)), 2, 2)


def test_preemption_by_recompute_keeps_outputs_exact():
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": 14})
    h = Harness(config)
    requests = {h.agent.submit(list(range(i, i + 20)), SamplingParams(max_tokens=12, seed=i, ignore_eos=True)):
                (list(range(i, i + 20)), i) for i in range(3)}
    h.run_until_idle()
    assert h.agent.stats()["preempted"] > 0
    for rid, (prompt, seed) in requests.items():
        assert h.outputs[rid] == standin_continuation(prompt, seed, 12)
    assert free_pages(h.scheduler.arrays) == 14


def test_admission_is_fcfs_and_a_policy_can_replace_it():
    from blink.device.policy import by_priority

    for policy, expected in [(None, [0, 1, 2, 3, 4]), (by_priority, [2, 4, 0, 1, 3])]:
        config = SchedulerConfig(**{**CONFIG.__dict__, "max_num_seqs": 1, "max_num_batched_tokens": 16})
        h = Harness(config, policy=policy)
        priorities = [5, 5, -1, 9, 0]
        ids = [h.agent.submit([i + 1], SamplingParams(max_tokens=1, seed=i), priority=p)
               for i, p in enumerate(priorities)]
        h.run_until_idle()
        order = [step["slots"][0] for step in h.steps]
        assert order == expected, policy
        assert sorted(h.reasons) == ids


def test_full_ring_and_unservable_requests():
    geometry = RingGeometry(n_slots=3, max_prompt_tokens=40, max_output_tokens=12, max_stop_ids=2, prefix_page_size=4)
    h = Harness(geometry=geometry)
    ok = [h.agent.submit([5, 6], SamplingParams(max_tokens=2, seed=i)) for i in range(2)]
    longest = h.agent.submit(list(range(40)), SamplingParams(max_tokens=12))    # exactly max_model_len
    with pytest.raises(RingFull):
        h.agent.submit([1], SamplingParams(max_tokens=1))
    h.run_until_idle()
    assert [h.reasons[r] for r in ok] == ["length", "length"] and h.reasons[longest] == "length"
    config = SchedulerConfig(**{**CONFIG.__dict__, "max_model_len": 48, "num_pages": 24})
    h = Harness(config)
    rejected = h.agent.submit(list(range(40)), SamplingParams(max_tokens=12))   # 52 > 48
    h.run_until_idle()
    assert h.reasons[rejected] == "error" and h.outputs.get(rejected, []) == []


@pytest.mark.parametrize("window", [False, True])
def test_shutdown_aborts_in_flight_requests_and_stops(window):
    """In the resident loop's order (``window``) settle reads the shutdown while the step prepare planned still
    runs: it only notes it, tearing down nothing the step reads; the next prepare, after the step, aborts every
    request in flight and stops the engine. In the tail loop's, collect reads it right before that prepare."""
    h = Harness()
    running = h.agent.submit([1, 2], SamplingParams(max_tokens=12, ignore_eos=True))
    h.iterate()
    waiting = [h.agent.submit([3], SamplingParams(max_tokens=4)) for _ in range(5)]
    h.agent.request_shutdown()
    if window:
        s = h.scheduler.arrays
        assert h.scheduler.iteration(PREPARE) >= 0, "the running request's next step"
        assert h.scheduler.iteration(SETTLE) == AGAIN, "a shutdown seen: the next prepare acts at once"
        assert s.sched[0].shutdown == 1 and s.sched[0].running == 1 and free_pages(s) < CONFIG.num_pages
        assert h.agent.stats()["engine_state"] != ENGINE_STOPPED and not any(out.finished for out in h.agent.poll())
        assert h.scheduler.iteration(PREPARE) == STOP
    else:
        assert h.scheduler.iteration() == STOP
    results = {out.request_id: out for out in h.agent.poll()}
    assert {results[r].finish_reason for r in [running] + waiting} == {"abort"}
    assert h.agent.stats()["engine_state"] == ENGINE_STOPPED
    assert free_pages(h.scheduler.arrays) == CONFIG.num_pages


def test_an_idle_watch_writes_nothing_and_answers_again_until_a_settle_acts_on_the_doorbell():
    """The idle resident loop looks at the doorbells with WATCH alone: it writes nothing (the ring, the scheduler's
    state and the step's buffers keep every byte), so the settle after it still sees what moved. It answers AGAIN
    after a submit, a cancel and a shutdown, each until a settle has acted on it, and IDLE while nothing moved."""
    h = Harness(window=True)
    s = h.scheduler.arrays

    def watch():
        before = {name: np.asarray(array).tobytes() for name, array in s._asdict().items()}
        answer = h.scheduler.iteration(WATCH)
        assert {name for name, array in s._asdict().items() if np.asarray(array).tobytes() != before[name]} == set()
        return answer

    assert watch() == IDLE
    rid = h.agent.submit([4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    assert watch() == AGAIN and watch() == AGAIN, "a look acts on nothing"
    assert h.settle_beside_the_step() == AGAIN and s.sched[0].queued == 1
    assert watch() == IDLE
    assert h.iterate() >= 0 and s.sched[0].running == 1
    assert watch() == IDLE, "running requests move no doorbell"
    h.agent.cancel(rid)
    assert watch() == AGAIN
    h.settle_beside_the_step()
    assert watch() == IDLE and s.sched[0].cancel_bell == 1, "the next prepare's retire acts on the cancel"
    h.agent.request_shutdown()
    assert watch() == AGAIN
    assert h.settle_beside_the_step() == AGAIN and h.scheduler.iteration(PREPARE) == STOP
    h.poll()
    assert h.reasons[rid] == "abort"


def test_settle_writes_no_step_buffer_and_the_next_prepare_admits_what_it_collected():
    """The resident loop runs settle while the step prepare planned runs: settle publishes, reads the doorbells,
    drops cancelled queued requests and collects new ones, writing none of the step's buffers. Here with all of it
    at once: tokens and admissions to publish, a request prepare retired, a new READY request, and cancels of a
    queued and a running request (which the next prepare's retire finishes)."""
    h = Harness(window=True)
    s, slot = h.scheduler.arrays, h.agent._slot_of
    params = [SamplingParams(max_tokens=1 if k == 0 else 6, seed=k, ignore_eos=True) for k in range(6)]
    rids = [h.agent.submit([4, 5], p) for p in params]         # 6 requests, max_num_seqs 4: two wait
    assert h.iterate() == AGAIN                                  # settle collects them
    assert h.iterate() >= 0 and s.sched[0].queued == 2           # prepare admits four: their prefills
    assert h.scheduler.iteration(PREPARE) >= 0                   # rids[0] took its only token: retired; rids[4] in
    assert s.sched[0].pending_finished == 1 and s.sched[0].queued == 1
    h.agent.cancel(rids[1])                                      # running
    h.agent.cancel(rids[5])                                      # queued
    late = h.agent.submit([6], SamplingParams(max_tokens=2, seed=9))
    assert h.settle_beside_the_step() == AGAIN
    assert s.seq_seen[slot[rids[5]]] == REFUSED and s.seq_seen[slot[late]] == QUEUED
    assert s.sched[0].cancel_bell == 1 and slot[rids[1]] in s.running[:s.sched[0].running], "retire's, next"
    assert h.scheduler.iteration(PREPARE) >= 0
    running = s.running[:s.sched[0].running].tolist()
    assert slot[late] in running and slot[rids[1]] not in running
    h.settle_beside_the_step()
    h.poll()
    h.run_until_idle()
    assert [h.reasons[r] for r in rids] == ["length", "abort", "length", "length", "length", "abort"]
    assert h.reasons[late] == "length" and h.outputs[late] == standin_continuation([6], 9, 2)
    for k in (0, 2, 3, 4):
        assert h.outputs[rids[k]] == standin_continuation([4, 5], k, params[k].max_tokens)


def test_logprobs_reach_the_ring_only_when_asked():
    from blink.ring.standin import standin_logprob

    h = Harness()
    with_lp = h.agent.submit([4, 5], SamplingParams(max_tokens=3, seed=8, logprobs=True))
    without = h.agent.submit([4, 5], SamplingParams(max_tokens=3, seed=8))
    got = {}
    for _ in range(10):
        h.scheduler.iteration()
        for out in h.agent.poll():
            got.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    tokens = [4, 5] + standin_continuation([4, 5], 8, 3)
    assert got[with_lp] == [standin_logprob(tokens[p - 1], p, 8) for p in range(2, 5)]
    assert got[without] == []


def test_top_logprobs_reach_the_ring_as_many_as_asked():
    from blink.ring.standin import standin_logprob

    h = Harness()
    rids = {top: h.agent.submit([4, 5], SamplingParams(max_tokens=3, seed=8, logprobs=top > 0, top_logprobs=top))
            for top in (0, 1, 2)}
    h.run_until_idle()
    tokens = [4, 5] + standin_continuation([4, 5], 8, 3)
    for top, rid in rids.items():
        want = [[(tokens[p] + j, standin_logprob(tokens[p - 1], p, 8) - j) for j in range(top)] for p in range(2, 5)]
        assert h.top[rid] == (want if top else []), top


@pytest.mark.parametrize("field, value", [("n_logit_bias", 4), ("top_logprobs", 3), ("n_logit_bias", 2**31)])
def test_a_header_asking_for_more_than_the_ring_holds_finishes_with_error(field, value):
    """A header the agent would never write (a bug, or a hostile writer of the ring): counts beyond the ring's rows
    are refused at admission, not read past the row."""
    h = Harness()
    rid = h.agent.submit([4, 5], SamplingParams(max_tokens=3, logprobs=True))
    ok = h.agent.submit([4, 5], SamplingParams(max_tokens=3))
    slot = h.agent._slot_of[rid]
    h.memory.write(h.layout.header_at(slot) + HEADER_DTYPE.fields[field][1], np.array([value], "<u4").tobytes())
    h.run_until_idle()
    assert (h.reasons[rid], h.outputs.get(rid, [])) == ("error", [])
    assert h.reasons[ok] == "length"


@pytest.mark.parametrize("start", [-4, (1 << 20) // 4 - 1, 2**31 - 1])
def test_a_header_whose_grammar_lies_outside_the_region_finishes_with_error(start):
    """A start state whose record would not fit the grammars region (a buggy or hostile writer of the ring) is
    refused at admission; the device never walks outside the region."""
    h = Harness()
    rid = h.agent.submit([4, 5], SamplingParams(max_tokens=3, grammar=GRAMMARS[0]))
    ok = h.agent.submit([4, 5], SamplingParams(max_tokens=3, grammar=GRAMMARS[1]))
    offset = h.layout.header_at(h.agent._slot_of[rid]) + HEADER_DTYPE.fields["grammar"][1]
    h.memory.write(offset, np.array([start], "<i4").tobytes())
    h.run_until_idle()
    assert (h.reasons[rid], h.outputs.get(rid, [])) == ("error", [])
    assert h.reasons[ok] == "length"


@pytest.mark.parametrize("word, value", [(0, 0), (0, 1 << 30), (3, -1), (3, 0), (3, 1 << 20)])
def test_a_placement_whose_header_does_not_fit_it_finishes_with_error(word, value):
    """A placement whose size leaves the region or whose start state is not a record inside it (written by a buggy
    or hostile writer of the ring) is refused at admission; the device never copies or walks outside it."""
    h = Harness()
    rid = h.agent.submit([4, 5], SamplingParams(max_tokens=3, grammar=GRAMMARS[0]))
    ok = h.agent.submit([4, 5], SamplingParams(max_tokens=3, grammar=GRAMMARS[1]))
    s = h.scheduler.arrays
    s.grammars[int(s.headers[h.agent._slot_of[rid]].grammar) + word] = value
    h.run_until_idle()
    assert (h.reasons[rid], h.outputs.get(rid, [])) == ("error", [])
    assert h.reasons[ok] == "length"


def test_the_scheduler_follows_its_mirror_of_a_placement_not_the_ring():
    """Once a request is collected its grammar is read from device memory only: the ring's copy overwritten after
    (which the agent never does while a request follows it) changes no state the scheduler plans."""
    h = Harness()
    rid = h.agent.submit([4, 5], SamplingParams(max_tokens=6, grammar=GRAMMARS[0]))
    h.iterate()                                 # collected (mirrored), admitted, its prompt planned
    s = h.scheduler.arrays
    base = int(s.headers[h.agent._slot_of[rid]].grammar)
    original, start = s.grammars.copy(), start_state(s.grammars, base)
    assert s.grammar_state[0] == start
    s.grammars[base + PLACEMENT_WORDS:base + int(s.grammars[base])] = -1     # every record word, not the header
    states = []
    while h.scheduler.iteration() >= 0:
        states.append(int(s.grammar_state[0]))
    tokens = [token for out in h.agent.poll() for token in out.new_tokens]
    want, state = [], start
    for token in tokens[:len(states)]:
        state = next_state(original, state, token, STANDIN_VOCAB)
        want.append(state)
    assert len(tokens) == 6 and states == want


def test_a_grammar_placed_where_another_was_is_mirrored_again():
    """A ring whose grammars region holds one grammar at a time: each request's grammar is placed at word 0 over the
    one before (under a new id), and every step's rows follow the placement their request names (the step contract
    compares the mirror with the ring)."""
    room = max(g.nbytes for g in GRAMMARS)
    h = Harness(geometry=RingGeometry(**{**GEOMETRY.__dict__, "max_grammar_bytes": room}))
    for k in (0, 1, 0, 2):
        rid = h.agent.submit([4, 5], SamplingParams(max_tokens=3, grammar=GRAMMARS[k]))
        assert h.scheduler.arrays.headers[h.agent._slot_of[rid]].grammar == 0
        h.run_until_idle()
        assert h.reasons[rid] == "length"
    assert len(h.steps) >= 4 * 3


def test_a_request_cancelled_during_chunked_prefill_finishes_with_abort_and_no_tokens():
    """Its previous steps sampled nothing, so nothing but the cancel makes its publication happen."""
    h = Harness()
    rid = h.agent.submit(list(range(40)), SamplingParams(max_tokens=4))     # 40 prompt tokens: 3 chunked steps
    h.iterate()                                                          # admit + first chunk (nothing sampled)
    h.agent.cancel(rid)
    h.run_until_idle()
    assert h.reasons[rid] == "abort" and h.outputs.get(rid, []) == []
    assert free_pages(h.scheduler.arrays) == CONFIG.num_pages


def test_prefills_that_hold_every_page_are_unblocked_by_preemption():
    """Regression: with no decode running, prefill chunks cut to zero free pages planned nothing forever."""
    h = Harness()
    s = h.scheduler.arrays
    h.agent.submit(list(range(40)), SamplingParams(max_tokens=12, seed=1))
    h.agent.submit(list(range(1, 41)), SamplingParams(max_tokens=12, seed=2))
    h.iterate()                                  # both admitted (10 + 10 pages of 24); the first one's first chunk
    s.sched[0].free_top -= int(s.sched[0].free_top)  # pages vanish under them (as if other sequences had taken them)
    outcome = h.scheduler.iteration()
    assert outcome >= 0 and h.agent.stats()["preempted"] >= 1


@pytest.mark.parametrize("refused_by", ["cancel of a queued request", "unservable request"])
def test_a_refused_request_is_finished_once_while_new_requests_arrive(refused_by):
    """Regression: a refused request stays READY in the ring until its FINISHED is published an iteration later; a
    scan in between (a new submission) took it again and counted it finished (and cancelled) twice."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "max_model_len": 48})
    h = Harness(config, threads=1)
    running = [h.agent.submit([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True, seed=i)) for i in range(4)]
    if refused_by == "unservable request":
        refused = h.agent.submit(list(range(40)), SamplingParams(max_tokens=12))     # 52 > max_model_len 48
        h.iterate()
    else:
        refused = h.agent.submit([4], SamplingParams(max_tokens=2))      # waits: max_num_seqs (4) are running
        h.iterate()
        h.agent.cancel(refused)
    later = [h.agent.submit([5], SamplingParams(max_tokens=1, seed=9))]
    h.iterate()                                  # refuses (or already refused) and scans for `later`
    later.append(h.agent.submit([6], SamplingParams(max_tokens=1, seed=9)))
    h.run_until_idle()                           # another scan before and after the refusal is published
    expected_reason = "abort" if refused_by.startswith("cancel") else "error"
    assert h.reasons[refused] == expected_reason and h.outputs.get(refused, []) == []
    assert all(h.reasons[r] == "length" for r in running + later)
    stats = h.agent.stats()
    assert stats["finished"] == len(running) + len(later) + 1
    assert stats["cancelled"] == (1 if expected_reason == "abort" else 0)
