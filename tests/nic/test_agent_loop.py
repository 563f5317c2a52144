"""blink.nic.agent_loop.AgentLoop: a request is checked before anything holds it, whichever way it goes (into the ring
at once, or into the wait queue of a full ring), and a refused one leaves no slot or queue entry behind; the loop's
own pauses (stalls, GC passes) reach /metrics."""
import asyncio
import gc
import time

import pytest

from blink.ring.errors import RequestError
from blink.ring.request import SamplingParams
from tests.nic.openai.local import GEOMETRY, run_local

VALID = ([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
OUT_OF_RANGE = [1, 2**31]                                        # not a token id the ring stores
TOO_LONG = SamplingParams(max_tokens=GEOMETRY.max_output_tokens + 1)


def test_a_refused_request_holds_no_slot_and_no_place_in_the_queue(local_ring, tokenizer):
    async def scenario(local):
        local.engine_runs.clear()                    # the engine stops stepping: what is in the ring stays there
        await asyncio.sleep(0.05)
        loop = local.server.loop
        for prompt, params in ((OUT_OF_RANGE, VALID[1]), (VALID[0], TOO_LONG)):
            with pytest.raises(RequestError):        # straight to the ring: its submit checks before a slot
                loop.submit(prompt, params, 0)
            assert loop.agent.in_flight == 0 and not loop.waiting
        held = [loop.submit(*VALID, 0) for _ in range(GEOMETRY.n_slots + 1)]
        assert loop.agent.in_flight == GEOMETRY.n_slots and list(loop.waiting) == held[-1:]
        for prompt, params in ((OUT_OF_RANGE, VALID[1]), (VALID[0], TOO_LONG)):
            with pytest.raises(RequestError):        # the ring is full: checked before it would wait
                loop.submit(prompt, params, 0)
            assert loop.agent.in_flight == GEOMETRY.n_slots and list(loop.waiting) == held[-1:]
        local.engine_runs.set()
        await local.until(lambda: loop.agent.in_flight == 0 and not loop.waiting)
        for req in held:
            loop.close(req)

    run_local(local_ring, tokenizer, scenario, serve=True)


def test_the_agent_counts_its_stalls_and_how_much_of_them_it_was_off_the_cpu(local_ring, tokenizer):
    """The event loop held up while a request is in flight is a stall in /metrics: a blocking sleep counts off the
    CPU, a spin on it; the idle loop's waits are no stall. A GC pass is timed by its generation."""
    stalls, seconds, off_cpu = ("blink_agent_stalls_total", "blink_agent_stall_seconds_total",
                                "blink_agent_stall_off_cpu_seconds_total")
    gen2 = 'blink_agent_gc_pause_seconds_count{generation="2"}'
    hold_s = 0.05

    async def held(local, hold) -> tuple[float, float, float]:
        """The change in the stall counters across one ``hold()`` of the event loop."""
        before = await local.metrics()
        await asyncio.sleep(0.01)                    # the loop polls the ring
        hold()
        await asyncio.sleep(0.01)                    # and polls again, after the hold
        after = await local.metrics()
        return tuple(after[name] - before[name] for name in (stalls, seconds, off_cpu))

    def spin():
        end = time.thread_time() + hold_s
        while time.thread_time() < end:
            pass

    async def scenario(local):
        await asyncio.sleep(0.25)                    # idle: the loop waits up to 100 ms at a time
        assert (await local.metrics())[stalls] == 0
        local.engine_runs.clear()                    # the engine stops stepping: the request stays in flight
        req = local.server.loop.submit(*VALID, 0)
        count, total, away = await held(local, lambda: time.sleep(hold_s))
        assert count >= 1 and total >= hold_s and away >= 0.8 * hold_s
        count, total, away = await held(local, spin)
        assert count >= 1 and total >= hold_s and total - away >= hold_s
        before = (await local.metrics())[gen2]
        gc.collect()
        assert (await local.metrics())[gen2] == before + 1
        local.engine_runs.set()
        await local.until(lambda: local.server.loop.agent.in_flight == 0)
        local.server.loop.close(req)

    run_local(local_ring, tokenizer, scenario, serve=True)
