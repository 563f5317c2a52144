import time

import numpy as np
import pytest

from blink.errors import EngineUnresponsive, IllegalTransition, RingFull, RingMismatch
from blink.nic.agent import Agent
from blink.ring.geometry import RingGeometry
from blink.ring.layout import FINISHED, FREE, READY, RUNNING, RingLayout
from blink.ring.reference import expected_output, standin_engine
from blink.ring.request import SamplingParams
from blink.ring.shares import Share
from blink.ring.standin import standin_continuation, standin_logprob, standin_token
from blink.ring.transport import LocalMemory

SMALL = RingGeometry(n_slots=4, max_prompt_tokens=8, max_output_tokens=16, max_stop_ids=2)


def drain(agent, consumer, max_steps=100):
    """Step the consumer and poll until nothing is in flight; return {request_id: (tokens, logprobs, reason)}."""
    results = {}
    for _ in range(max_steps):
        consumer.step()
        for out in agent.poll():
            tokens, logprobs, _ = results.get(out.request_id, ([], [], None))
            results[out.request_id] = (tokens + out.new_tokens, logprobs + (out.new_logprobs or []),
                                       out.finish_reason)
        if not agent.in_flight:
            return results
    raise AssertionError("requests did not finish")


def state_of(memory, agent, slot):
    return int(np.frombuffer(memory.read(agent.layout.status_at("state", slot), 4), "<u4")[0])


def test_requests_get_exactly_the_stand_in_tokens(local_ring):
    memory, agent, consumer = local_ring(SMALL)
    prompts = {agent.submit([5, 6, 7], SamplingParams(max_tokens=6, seed=1, logprobs=True)): ([5, 6, 7], 1, 6),
               agent.submit([9], SamplingParams(max_tokens=1, seed=2)): ([9], 2, 1),
               agent.submit(list(range(8)), SamplingParams(max_tokens=4, seed=2**64 - 1)): (list(range(8)), 2**64 - 1,
                                                                                          4)}
    results = drain(agent, consumer)
    for rid, (prompt, seed, n) in prompts.items():
        tokens, logprobs, reason = results[rid]
        assert tokens == standin_continuation(prompt, seed, n)
        assert reason == "length"
    tokens, logprobs, _ = results[1]
    full = [5, 6, 7] + tokens
    assert logprobs == [standin_logprob(full[p - 1], p, 1) for p in range(3, 9)]
    assert agent.tracker.n_free == 4 and all(state_of(memory, agent, s) == FREE for s in range(4))


BAD_INPUTS = [
    ([], SamplingParams(), "prompt_tokens"),
    ([[1, 2]], SamplingParams(), "prompt_tokens"),
    ([1.5], SamplingParams(), "prompt_tokens"),
    (list(range(9)), SamplingParams(), "max_prompt_tokens"),
    ([-1], SamplingParams(), "prompt_tokens"),
    ([2**31], SamplingParams(), "prompt_tokens"),
    ([1], SamplingParams(max_tokens=17), "max_tokens"),
    ([1], SamplingParams(stop_token_ids=(1, 2, 3)), "stop_token_ids"),
    ([1], "greedy", "params"),
]


@pytest.mark.parametrize("prompt,params,field", BAD_INPUTS)
def test_bad_input_names_the_field_and_leaves_the_ring_untouched(local_ring, prompt, params, field):
    memory, agent, _ = local_ring(SMALL)
    before = memory.read(0, memory.size)
    with pytest.raises(ValueError, match=field):
        agent.submit(prompt, params)
    assert memory.read(0, memory.size) == before
    assert agent.tracker.n_free == 4 and agent.in_flight == 0


def test_logprobs_need_a_ring_with_a_logprobs_area(local_ring):
    memory, agent, _ = local_ring(RingGeometry(n_slots=2, max_prompt_tokens=4, max_output_tokens=4, logprobs=False))
    with pytest.raises(ValueError, match="logprobs"):
        agent.submit([1], SamplingParams(max_tokens=1, logprobs=True))


def test_full_ring_raises_ring_full_then_recovers_after_poll(local_ring):
    memory, agent, consumer = local_ring(SMALL)
    ids = [agent.submit([1], SamplingParams(max_tokens=1, seed=i)) for i in range(4)]
    before = memory.read(0, memory.size)
    with pytest.raises(RingFull):
        agent.submit([1], SamplingParams(max_tokens=1))
    assert memory.read(0, memory.size) == before
    consumer.step()
    finished = [out.request_id for out in agent.poll() if out.finished]
    assert sorted(finished) == ids
    agent.submit([1], SamplingParams(max_tokens=1))


def test_slot_is_released_only_after_finished_and_delivered(local_ring):
    memory, agent, consumer = local_ring(RingGeometry(n_slots=1, max_prompt_tokens=4, max_output_tokens=4))
    agent.submit([3], SamplingParams(max_tokens=2, seed=0))
    consumer.step()
    consumer.step()                                   # FINISHED on the GPU side, not yet polled
    assert state_of(memory, agent, 0) != FREE
    with pytest.raises(RingFull):
        agent.submit([3], SamplingParams(max_tokens=1))
    (out,) = agent.poll()
    assert out.finished and len(out.new_tokens) == 2
    assert state_of(memory, agent, 0) == FREE


def test_cancel_ready_and_running_requests(local_ring):
    memory, agent, consumer = local_ring(SMALL, max_running=1)
    running = agent.submit([1], SamplingParams(max_tokens=6, seed=3))
    waiting = agent.submit([2], SamplingParams(max_tokens=6, seed=4))
    consumer.step()
    consumer.step()
    assert agent.cancel(running) and agent.cancel(waiting)
    results = drain(agent, consumer)
    assert results[running] == (standin_continuation([1], 3, 2), [], "abort")
    assert results[waiting] == ([], [], "abort")
    assert not agent.cancel(running), "a finished request is no longer cancellable"
    assert not agent.cancel(12345)
    assert agent.stats()["cancelled"] == 2


def test_stale_cancel_of_a_recycled_slot_is_ignored(local_ring):
    memory, agent, consumer = local_ring(RingGeometry(n_slots=1, max_prompt_tokens=4, max_output_tokens=4))
    first = agent.submit([1], SamplingParams(max_tokens=1))
    old_epoch = int(agent._epoch[0])
    drain(agent, consumer)
    second = agent.submit([1], SamplingParams(max_tokens=3, seed=9))
    # a cancel meant for `first`, arriving late
    memory.write(agent.layout.status_at("cancel", 0), np.array([old_epoch], "<u4").tobytes())
    results = drain(agent, consumer)
    assert first != second and results[second] == (standin_continuation([1], 9, 3), [], "length")


def test_stop_ids_and_eos_end_requests_and_stay_in_the_output(local_ring):
    prompt, seed = [11, 12], 5
    tokens = standin_continuation(prompt, seed, 6)
    memory, agent, consumer = local_ring(SMALL, eos_token_ids=[tokens[2]])
    a = agent.submit(prompt, SamplingParams(max_tokens=6, seed=seed))
    b = agent.submit(prompt, SamplingParams(max_tokens=6, seed=seed, ignore_eos=True))
    c = agent.submit(prompt, SamplingParams(max_tokens=6, seed=seed, ignore_eos=True, stop_token_ids=(tokens[4],)))
    results = drain(agent, consumer)
    first_eos = tokens.index(tokens[2])
    assert results[a] == (tokens[:first_eos + 1], [], "stop")
    assert results[b] == (tokens, [], "length")
    assert results[c] == (tokens[:tokens.index(tokens[4]) + 1], [], "stop")


def test_agent_refuses_a_ring_of_another_geometry():
    layout = RingLayout(SMALL)
    with LocalMemory(layout.size) as memory:
        with pytest.raises(RingMismatch, match="magic"):
            Agent(memory, SMALL)
        memory.write(0, layout.control_bytes())
        with pytest.raises(RingMismatch, match="max_output_tokens"):
            Agent(memory, RingGeometry(n_slots=4, max_prompt_tokens=8, max_output_tokens=15, max_stop_ids=2))
        with pytest.raises(ValueError, match="needs"):
            Agent(memory, RingGeometry(n_slots=4000))


def test_frozen_heartbeat_raises_engine_unresponsive(local_ring):
    memory, agent, consumer = local_ring(SMALL, liveness_timeout_s=0.05)
    agent.poll()                                       # nothing in flight: never an error
    time.sleep(0.1)
    agent.poll()
    agent.submit([1], SamplingParams(max_tokens=3))
    agent.poll()
    time.sleep(0.1)
    with pytest.raises(EngineUnresponsive, match="heartbeat has been stuck"):
        agent.poll()
    consumer.step()                                    # the consumer comes back: polling works again
    assert agent.poll()[0].new_tokens


def test_launch_error_reported_by_the_gpu_side_is_raised(local_ring):
    memory, agent, consumer = local_ring(SMALL)
    consumer.view.control["launch_error"] = 400
    with pytest.raises(EngineUnresponsive, match="launch error 400"):
        agent.poll()


def test_another_writer_changing_an_epoch_is_detected(local_ring):
    memory, agent, consumer = local_ring(SMALL)
    agent.submit([1], SamplingParams(max_tokens=3))
    consumer.step()
    consumer.view.status["epoch"][0] += 1
    with pytest.raises(IllegalTransition, match="epoch changed"):
        agent.poll()


def test_agent_attaching_to_a_used_ring_does_not_take_busy_slots(local_ring):
    memory, first, consumer = local_ring(SMALL)
    first.submit([1], SamplingParams(max_tokens=5))
    second = Agent(memory, SMALL)
    assert second.tracker.n_free == 3
    assert second._slot_of[second.submit([2], SamplingParams(max_tokens=1))] != 0


def test_stand_in_token_is_a_pure_function_of_its_inputs():
    assert standin_token(1, 2, 3) == standin_token(1, 2, 3)
    values = {standin_token(t, p, s) for t in range(4) for p in range(4) for s in range(4)}
    assert len(values) > 60 and all(0 <= v < 32000 for v in values)


# -- agent and consumer in separate processes, over POSIX shared memory ----------------------------------------------

def test_ten_thousand_requests_across_processes_each_answered_once_and_right():
    geometry = RingGeometry(n_slots=256, max_prompt_tokens=32, max_output_tokens=16, max_stop_ids=1)
    eos = 7
    rng = np.random.default_rng(1234)
    with standin_engine(geometry, eos_token_ids=[eos], max_running=128) as (memory, process):
        agent = Agent(memory, geometry, liveness_timeout_s=30)
        expected, received = {}, {}
        total, submitted, deadline = 10_000, 0, time.monotonic() + 240
        while submitted < total or agent.in_flight:
            assert time.monotonic() < deadline, f"only {len(received)} of {total} answered"
            while submitted < total and agent.tracker.n_free:
                prompt = rng.integers(0, 32000, rng.integers(1, 33)).tolist()
                params = SamplingParams(max_tokens=int(rng.integers(1, 17)), seed=int(rng.integers(0, 2**63)),
                                        stop_token_ids=(int(rng.integers(0, 32000)),), ignore_eos=bool(submitted % 2))
                expected[agent.submit(prompt, params)] = (prompt, params)
                submitted += 1
            for out in agent.poll():
                tokens, reason = received.get(out.request_id, ([], None))
                assert reason is None, f"request {out.request_id} reported after it finished"
                received[out.request_id] = (tokens + out.new_tokens, out.finish_reason)
        assert len(received) == total
        for rid, (prompt, params) in expected.items():
            assert received[rid] == expected_output(prompt, params, (eos,)), rid
        assert agent.tracker.n_free == geometry.n_slots
        assert agent.poll() == []                      # a final poll sees nothing new
        stats = agent.stats()
        assert stats["admitted"] == stats["finished"] == total
        agent.request_shutdown()
        process.join(10)
        assert process.exitcode == 0


def test_a_killed_consumer_process_gives_a_clear_error_not_a_hang():
    geometry = RingGeometry(n_slots=16, max_prompt_tokens=4, max_output_tokens=1000)
    with standin_engine(geometry) as (memory, process):
        agent = Agent(memory, geometry, liveness_timeout_s=0.5)
        while agent.stats()["heartbeat"] < 10:         # the consumer is serving
            time.sleep(0.01)
        process.kill()
        process.join(10)
        rid = agent.submit([1], SamplingParams(max_tokens=1000, ignore_eos=True))
        start = time.monotonic()
        with pytest.raises(EngineUnresponsive, match="heartbeat has been stuck"):
            while time.monotonic() - start < 10:
                agent.poll()
                time.sleep(0.01)
        assert time.monotonic() - start < 5
        assert agent.in_flight == 1 and rid in agent._slot_of


def test_a_recycled_ready_slot_does_not_report_the_previous_occupants_tokens(local_ring):
    """Regression: n_generated of a READY slot belongs to the previous request until the GPU admits the new one."""
    memory, agent, consumer = local_ring(RingGeometry(n_slots=1, max_prompt_tokens=4, max_output_tokens=4))
    agent.submit([1], SamplingParams(max_tokens=3))
    drain(agent, consumer)
    second = agent.submit([2], SamplingParams(max_tokens=2, seed=4))
    assert consumer.view.status["n_generated"][0] == 3
    assert agent.poll() == []
    consumer.step()
    (out,) = agent.poll()
    assert out.request_id == second and out.new_tokens == standin_continuation([2], 4, 1)


def test_priority_is_written_to_the_header_and_validated(local_ring):
    memory, agent, consumer = local_ring(SMALL)
    agent.submit([1], SamplingParams(max_tokens=1), priority=-7)
    assert consumer.view.headers["priority"][0] == -7
    with pytest.raises(ValueError, match="priority"):
        agent.submit([1], SamplingParams(max_tokens=1), priority=2**31)


@pytest.mark.parametrize("priority", [2**31, -2**31 - 1, 1.5, True])
def test_a_value_that_does_not_fit_its_header_field_claims_no_slot(local_ring, priority):
    """Regression (slot leak, then a hung server): a value that overflowed its header field was found only after a
    slot had been claimed, and that slot was never released. Checks run before the claim, so 4 x capacity refusals
    leave every slot free."""
    memory, agent, _ = local_ring(SMALL)
    before = memory.read(0, memory.size)
    for _ in range(4 * SMALL.n_slots):
        with pytest.raises(ValueError, match="priority"):
            agent.submit([1], SamplingParams(max_tokens=1), priority=priority)
    assert memory.read(0, memory.size) == before
    assert agent.tracker.n_free == SMALL.n_slots and agent.in_flight == 0
    agent.submit([1], SamplingParams(max_tokens=1))


def test_a_failed_publish_releases_its_slot(local_ring):
    """A write that fails after the claim (a transport error, say) gives the slot back to the tracker."""
    memory, agent, _ = local_ring(SMALL)
    real_write = memory.write

    def failing_write(offset, data):
        raise OSError("the transport went away")

    memory.write = failing_write
    with pytest.raises(OSError):
        agent.submit([1], SamplingParams(max_tokens=1))
    memory.write = real_write
    assert agent.tracker.n_free == SMALL.n_slots and agent.in_flight == 0


def test_a_ring_with_prefix_keys_gets_each_prompts_page_keys_and_chain_state(local_ring):
    from blink.ring.hashing import reference_keys

    geometry = RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=4, max_stop_ids=0, prefix_page_size=3)
    memory, agent, consumer = local_ring(geometry)
    seed = int(consumer.view.control["prefix_seed"][0])
    assert seed != 0, "the creator draws a seed"
    prompt = [5, 6, 7, 8, 9, 10, 11]
    agent.submit(prompt, SamplingParams(max_tokens=1))
    keys, state = reference_keys(prompt, 3, seed)
    assert consumer.view.prefix_keys[0, :2].tolist() == keys and consumer.view.headers["prefix_state"][0] == state
    agent.submit([1, 2], SamplingParams(max_tokens=1))       # no full page: only the state
    assert consumer.view.headers["prefix_state"][1] == reference_keys([1, 2], 3, seed)[1]


# -- several agents on one ring (blink.ring.shares) ------------------------------------------------------------------

def test_agents_of_one_ring_fill_only_their_own_slots_and_get_their_own_answers(local_ring):
    geometry = RingGeometry(n_slots=5, max_prompt_tokens=8, max_output_tokens=16, max_stop_ids=2)
    memory, _, consumer = local_ring(geometry)
    agents = [Agent(memory, geometry, share=Share(i, 2)) for i in range(2)]
    sent = []
    for k, agent in enumerate(agents):
        while agent.tracker.n_free:
            params = SamplingParams(max_tokens=3 + k, seed=len(sent))
            sent.append((k, agent.submit([k, len(sent)], params), [k, len(sent)], params))
        with pytest.raises(RingFull):
            agent.submit([1], SamplingParams(max_tokens=1))
    state = consumer.view.status["state"]
    assert [k for k, *_ in sent] == [0, 0, 1, 1, 1] and (state != FREE).all()
    assert {agents[k]._slot_of[rid] for k, rid, *_ in sent if k == 0} == {0, 1}
    results = [{}, {}]
    for _ in range(20):
        consumer.step()
        for k, agent in enumerate(agents):
            for out in agent.poll():
                tokens, _ = results[k].get(out.request_id, ([], None))
                results[k][out.request_id] = (tokens + out.new_tokens, out.finish_reason)
    for k, rid, prompt, params in sent:
        assert results[k][rid] == expected_output(prompt, params)
    assert all(agent.tracker.n_free == len(agent.slots) for agent in agents) and (state == FREE).all()


def test_an_agent_finishes_what_a_dead_agent_of_its_slots_left_and_no_other_agents_requests():
    """The dead agent's slots: FINISHED (freed at once), RUNNING and READY (cancelled, freed once the engine
    finished them, their tokens dropped); until then no grammar is placed. The other agent's request runs on."""
    from blink.ring.grammar import Grammar
    from blink.ring.reference import ReferenceConsumer

    geometry = RingGeometry(n_slots=6, max_prompt_tokens=8, max_output_tokens=16, max_stop_ids=2,
                            max_grammar_bytes=256, vocab_size=32)
    layout = RingLayout(geometry)
    memory = LocalMemory(layout.size)
    layout.initialise(memory)
    consumer = ReferenceConsumer(layout.view(memory.buffer), max_running=2)
    other = Agent.attach(memory, Share(0, 2))
    kept = other.submit([4], SamplingParams(max_tokens=8, seed=4))
    dead = Agent.attach(memory, Share(1, 2))
    dead.submit([1], SamplingParams(max_tokens=1, seed=1))                 # finished before it died
    consumer.step()
    dead.submit([2], SamplingParams(max_tokens=16, seed=2, ignore_eos=True))   # running (the other's runs too)
    dead.submit([3], SamplingParams(max_tokens=16, seed=3, ignore_eos=True))   # waiting for a running place
    consumer.step()
    state = consumer.view.status["state"]
    assert [int(s) for s in state[3:]] == [FINISHED, RUNNING, READY], "slots 3-5 are the dead agent's"
    cancelled = other.stats()["cancelled"]
    successor = Agent.attach(memory, Share(1, 2, restarts=1))              # the dead agent is gone
    assert state[3] == FREE and successor.in_flight == 2 and successor.tracker.n_free == 1
    with pytest.raises(RingFull, match="a grammar waits"):
        successor.submit([1], SamplingParams(max_tokens=1, grammar=Grammar(("regex", "g"), 32, np.zeros(8, np.int32),
                                                                           np.array([0]), 0, 1)))
    results = drain(successor, consumer)
    assert sorted(reason for _, _, reason in results.values()) == ["abort", "abort"]
    assert (state[3:] == FREE).all() and successor.tracker.n_free == 3 and not successor._taken_over
    assert other.stats()["cancelled"] == cancelled + 2
    tokens, _, reason = drain(other, consumer)[kept]
    assert (tokens, reason) == expected_output([4], SamplingParams(max_tokens=8, seed=4))
