"""blink.nic.agent_loop.AgentLoop.submit: a request is checked before anything holds it, whichever way it goes (into
the ring at once, or into the wait queue of a full ring), and a refused one leaves no slot or queue entry behind."""
import asyncio

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
