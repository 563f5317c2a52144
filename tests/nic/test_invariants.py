"""blink.nic.invariants: with nothing in flight, no KV page, ring slot or request is left held; a violation is
confirmed over two engine iterations, logged once and counted in /metrics (``blink_invariant_violations_total``).
Reference: the rules of the module docstring, on hand-written control-block snapshots, and a leak written into a
served ring's control block."""
import asyncio
import logging

import pytest

from blink.nic.invariants import IdleInvariants, idle_violations
from blink.ring import control
from tests.nic.openai.local import GEOMETRY, run_local

N_SLOTS = 4


def snapshot(heartbeat=10, submitted=5, finished=5, running=0, waiting=0, kv_pages_free=16, kv_pages_total=16):
    return dict(heartbeat=heartbeat, submitted=submitted, finished=finished, running=running, waiting=waiting,
                kv_pages_free=kv_pages_free, kv_pages_total=kv_pages_total)


def test_each_idle_invariant_is_checked():
    assert idle_violations(snapshot(), N_SLOTS, N_SLOTS) == set()
    assert len(idle_violations(snapshot(running=1, waiting=1), N_SLOTS, N_SLOTS)) == 1
    assert idle_violations(snapshot(finished=4), N_SLOTS, N_SLOTS) == {"the engine finished 4 of 5 submitted requests"}
    assert idle_violations(snapshot(kv_pages_free=13), N_SLOTS, N_SLOTS) == {
        "3 of 16 KV pages are neither free nor evictable"}
    assert idle_violations(snapshot(), N_SLOTS - 1, N_SLOTS) == {"the agent holds 1 of its 4 ring slots"}
    # Where several agents serve the ring the doorbell does not count requests: that check is left out.
    assert idle_violations(snapshot(finished=4, submitted=9000), N_SLOTS, N_SLOTS, counted=False) == set()


def test_a_violation_counts_once_it_held_over_two_iterations_and_is_reported_once():
    checks = IdleInvariants(N_SLOTS)
    leak = dict(kv_pages_free=15)
    assert checks.check(snapshot(heartbeat=10, **leak), N_SLOTS) == set()
    assert checks.check(snapshot(heartbeat=11, **leak), N_SLOTS) == set()        # one iteration: gauges may lag
    assert checks.check(snapshot(heartbeat=12, **leak), N_SLOTS) == {"1 of 16 KV pages are neither free nor evictable"}
    assert checks.check(snapshot(heartbeat=20, **leak), N_SLOTS) == set()        # still broken: reported already
    checks.busy()                                                                # requests come and go
    assert checks.check(snapshot(heartbeat=30, submitted=6, finished=6, **leak), N_SLOTS) == set()
    assert checks.check(snapshot(heartbeat=32, submitted=6, finished=6, **leak), N_SLOTS) == set()
    assert checks.check(snapshot(heartbeat=34, submitted=6, finished=6), N_SLOTS) == set()          # it cleared
    assert checks.check(snapshot(heartbeat=36, submitted=6, finished=6, **leak), N_SLOTS) == set()  # it is back
    assert len(checks.check(snapshot(heartbeat=38, submitted=6, finished=6, **leak), N_SLOTS)) == 1


def test_a_passing_lag_or_a_new_submission_is_no_violation():
    checks = IdleInvariants(N_SLOTS)
    assert checks.check(snapshot(heartbeat=10, running=1), N_SLOTS) == set()     # gauges not yet published
    assert checks.check(snapshot(heartbeat=12), N_SLOTS) == set()
    assert checks.check(snapshot(heartbeat=14, submitted=6), N_SLOTS) == set()   # submitted since: judged anew
    assert checks.check(snapshot(heartbeat=20, submitted=6, finished=6), N_SLOTS) == set()


def test_a_served_ring_that_leaks_a_page_is_logged_once_and_counted(local_ring, tokenizer, caplog):
    async def scenario(local):
        assert (await local.complete(max_tokens=4))[0] == 200
        await asyncio.sleep(0.5)                    # idle samples of a healthy ring
        assert (await local.metrics())["blink_invariant_violations_total"] == 0
        control.write(local.memory, "kv_pages_total", 64)      # the GPU side "leaks" three pages
        control.write(local.memory, "kv_pages_free", 61)
        await asyncio.sleep(0.5)
        assert (await local.metrics())["blink_invariant_violations_total"] == 1

    with caplog.at_level(logging.ERROR, logger="blink.agent"):
        run_local(local_ring, tokenizer, scenario, serve=True)
    leaks = [r for r in caplog.records if "3 of 64 KV pages" in r.getMessage()]
    assert len(leaks) == 1, caplog.text
    assert GEOMETRY.n_slots == N_SLOTS


@pytest.mark.parametrize("shared", [True, False])
def test_an_idle_agent_judges_nothing_while_another_agent_of_its_ring_has_requests(local_ring, shared):
    """Two agents on one ring, one running a request, the other idle: the engine is busy, and the idle agent, which
    sees the other's slot in use, checks nothing. The control: an idle agent that takes itself for the ring's only
    one (a plain Agent, the other's request invisible to it) reports the engine's running request as a violation."""
    from blink.nic.agent import Agent
    from blink.nic.agent_loop import AgentLoop
    from blink.nic.metrics import Metrics
    from blink.ring.request import SamplingParams
    from blink.ring.shares import Share

    memory, _, consumer = local_ring(GEOMETRY)
    control.write(memory, "engine_state", control.ENGINE_SERVING)
    busy = Agent(memory, GEOMETRY, share=Share(0, 2) if shared else Share())
    idle = Agent(memory, GEOMETRY, share=Share(1, 2) if shared else Share())
    busy.submit([1, 2], SamplingParams(max_tokens=GEOMETRY.max_output_tokens, ignore_eos=True))
    loop = AgentLoop(idle, Metrics())
    for _ in range(4):                  # engine iterations apart, the request running throughout
        consumer.step()
        loop._sample()
    violations = int(loop.metrics.invariant_violations._value.get())
    assert violations == 0 if shared else violations > 0
