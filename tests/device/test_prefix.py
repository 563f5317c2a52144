"""Prefix caching in the scheduler iteration (device code under the CUDA simulator, driven through the ring by a real
Agent, every step and every page checked by ``test_scheduler.Harness``): outputs are the same with and without
caching on workloads of shared prefixes, chunked prefill, preemption, eviction and cancellation; a cached prefix is
not computed again (``prefill_tokens``), a conversation's next turn finds the pages of the previous answer, the
cache's counters add up."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device.test_scheduler import CONFIG, Harness, free_pages, without_caching

from blink.device.config import SchedulerConfig
from blink.ring.reference import expected_output
from blink.ring.request import SamplingParams
from blink.ring.standin import standin_continuation

PAGE = CONFIG.page_size
SYSTEM = [list(range(500, 524)), list(range(500, 512)) + list(range(900, 912))]   # 6 pages each, 3 in common


def run(h, schedule, limit=400):
    """Submit ``(arrival iteration, prompt, params, cancel after)`` at their iterations; iterate until idle. Returns
    {request id: (prompt, params, cancelled)}."""
    submitted = {}
    for iteration in range(limit):
        for arrival, prompt, params, cancel_after in schedule:
            if arrival == iteration:
                submitted[h.agent.submit(prompt, params)] = [prompt, params, cancel_after, False]
        for rid, entry in submitted.items():
            if entry[2] is not None and iteration == entry[2] and h.agent.cancel(rid):
                entry[3] = True
        if h.iterate() < 0 and not h.agent.in_flight and iteration > max(a for a, *_ in schedule):
            return submitted
    raise AssertionError("not idle")


def check_outputs(h, submitted, eos):
    for rid, (prompt, params, _, cancelled) in submitted.items():
        tokens, reason = expected_output(prompt, params, eos)
        got = h.outputs.get(rid, [])
        if cancelled and h.reasons[rid] == "abort":
            assert got == tokens[:len(got)]
        else:
            assert (got, h.reasons[rid]) == (tokens, reason)
    assert free_pages(h.scheduler.arrays) == h.config.num_pages, "a page leaked"


request = st.tuples(st.integers(0, 1), st.integers(0, 24), st.lists(st.integers(0, 3), max_size=12),
                    st.integers(1, 12), st.integers(0, 2**64 - 1), st.integers(0, 8), st.none() | st.integers(0, 4))


@settings(max_examples=12, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=8), num_pages=st.sampled_from([13, 16, 40]),
       threads=st.sampled_from([1, 3]), caching=st.booleans())
def test_shared_prefix_workloads_match_the_reference(requests, num_pages, threads, caching):
    """System prompts cut anywhere, short tails, staggered arrivals, cancellations; small pools preempt and evict."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": num_pages, "eos_token_ids": (7,)})
    h = Harness(config, threads=threads) if caching else Harness(*without_caching(config), threads=threads)
    schedule = []
    for system, cut, tail, max_tokens, seed, arrival, cancel in requests:
        prompt = (SYSTEM[system][:cut] + tail)[:40] or [1]
        params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=bool(seed % 2))
        schedule.append((arrival, prompt, params, None if cancel is None else arrival + cancel))
    check_outputs(h, run(h, schedule), config.eos_token_ids)
    stats = h.agent.stats()
    assert stats["prefix_hit_tokens"] <= stats["prefix_query_tokens"]
    assert stats["cached_pages"] == int(h.scheduler.arrays.sched[0].cached) <= num_pages
    if not caching:
        assert stats["prefix_query_tokens"] == stats["cached_pages"] == 0


def test_a_repeated_prompt_computes_only_what_is_not_cached():
    """A prompt of 4 full pages and one of 5.5: sent again, they hit 3 and 5 pages (the last prompt token is always
    computed, so a page-aligned prompt recomputes its whole last page); outputs are the first run's."""
    h = Harness()
    prompts = [list(range(100, 116)), list(range(200, 222))]
    params = SamplingParams(max_tokens=3, seed=9, ignore_eos=True)
    first = [h.agent.submit(p, params) for p in prompts]
    h.run_until_idle()
    before = h.agent.stats()
    assert before["prefill_tokens"] == 16 + 22 and before["prefix_hit_tokens"] == 0
    second = [h.agent.submit(p, params) for p in prompts]
    h.run_until_idle()
    after = h.agent.stats()
    assert [h.outputs[r] for r in second] == [h.outputs[r] for r in first] == \
        [standin_continuation(p, 9, 3) for p in prompts]
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == (3 + 5) * PAGE
    assert after["prefill_tokens"] - before["prefill_tokens"] == (16 - 3 * PAGE) + (22 - 5 * PAGE)
    assert after["prefix_query_tokens"] == 2 * (16 + 22)


def test_a_conversations_next_turn_finds_the_pages_of_the_previous_answer():
    """Turn 2's prompt is turn 1's prompt, its answer and a new question: every page whose K/V turn 1 computed hits,
    the answer's included (their keys were hashed on the GPU); the last answer token was never fed back, so the
    page holding it is computed anew."""
    h = Harness()
    question = list(range(300, 310))
    params = SamplingParams(max_tokens=12, seed=4, ignore_eos=True)
    rid = h.agent.submit(question, params)
    h.run_until_idle()
    answer = h.outputs[rid]
    turn2 = question + answer + [42, 43, 44]
    rid2 = h.agent.submit(turn2, params)
    h.run_until_idle()
    assert h.outputs[rid2] == standin_continuation(turn2, 4, 12)
    computed = len(question) + len(answer) - 1               # positions whose K/V turn 1 wrote
    assert h.agent.stats()["prefix_hit_tokens"] == computed // PAGE * PAGE == 20


def test_cached_pages_are_evicted_oldest_first_under_memory_pressure():
    """A pool of 14 pages, distinct prompts of 5 pages one after another: the cache fills, then every admission
    evicts; the repeat of the newest prompt still hits, the oldest was evicted."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": 14})
    h = Harness(config)
    params = SamplingParams(max_tokens=2, seed=1, ignore_eos=True)
    prompts = [list(range(1000 * k, 1000 * k + 18)) for k in range(1, 6)]
    for prompt in prompts:
        h.agent.submit(prompt, params)
        h.run_until_idle()
    stats = h.agent.stats()
    assert stats["prefix_evictions"] > 0 and stats["cached_pages"] <= 14
    for prompt, hits in [(prompts[-1], 4), (prompts[0], 0)]:
        before = h.agent.stats()["prefix_hit_tokens"]
        rid = h.agent.submit(prompt, params)
        h.run_until_idle()
        assert h.agent.stats()["prefix_hit_tokens"] - before == hits * PAGE
        assert h.outputs[rid] == standin_continuation(prompt, 1, 2)


def test_shared_pages_outlive_the_cancel_and_the_preemption_of_their_other_holders():
    """Three requests share a 5-page system prompt in a pool too small for all of them: one is cancelled, others
    are preempted while the shared pages stay held; the Harness checks every read of them."""
    config = SchedulerConfig(**{**CONFIG.__dict__, "num_pages": 13})
    h = Harness(config)
    system = list(range(700, 720))
    params = SamplingParams(max_tokens=12, seed=3, ignore_eos=True)
    warm = h.agent.submit(system + [1], params)
    h.run_until_idle()
    schedule = [(0, system + [2, 3, 4, 5, 6], params, None), (0, system + [7], params, 11),
                (1, system + [8, 9], params, None)]
    submitted = run(h, schedule)
    check_outputs(h, submitted, ())
    assert h.outputs[warm] == standin_continuation(system + [1], 3, 12)
    stats = h.agent.stats()
    assert stats["preempted"] > 0 and stats["cancelled"] == 1 and stats["prefix_hit_tokens"] >= 3 * 5 * PAGE
