"""``blink.nic.drain`` over HTTP, the engine being the reference consumer stepped in the server's own loop
(``local.py``), so the test decides when the requests in flight can finish: a drain refuses new requests with 503 +
Retry-After, lets every request it found (queued ones included) finish, and at its deadline ends the rest with an
error and frees their slots; a second signal ends them at once. (``tests/test_lifecycle.py``: the same through real
signals to ``blink serve``.)"""
import asyncio
import json
import os
import signal
import time

import pytest

from blink.nic.drain import DrainConfig
from blink.nic.openai import server as server_module
from blink.nic.openai.server import OpenAIServer, ServerConfig
from tests.nic.openai.local import GEOMETRY, finished, run_local


def run(local_ring, tokenizer, scenario, **options):
    run_local(local_ring, tokenizer, scenario, serve=True, **options)


async def stalled_requests(local, n: int) -> list[asyncio.Task]:
    """``n`` completions, alternately streamed, held by a stalled engine (the last ones queued in the agent)."""
    local.engine_runs.clear()
    requests = [asyncio.create_task(local.complete(stream=bool(i % 2))) for i in range(n)]
    loop = local.server.loop                        # tokenizing runs in threads: wait until all n reached the agent
    await local.until(lambda: local.server.drain.in_flight == n and loop.agent.in_flight + len(loop.waiting) == n)
    return requests


def test_a_drain_refuses_new_requests_and_finishes_every_one_in_flight(local_ring, tokenizer):
    async def scenario(local):
        server = local.server
        requests = await stalled_requests(local, GEOMETRY.n_slots + 2)
        assert len(server.loop.waiting) == 2
        drained = asyncio.create_task(server.drain.run())
        status, headers, body = await local.complete()
        assert status == 503 and headers["Retry-After"] == "1"
        assert "draining" in json.loads(body)["error"]["message"]
        assert server.drain.in_flight == GEOMETRY.n_slots + 2     # the refused one was never counted
        await asyncio.sleep(0.3)
        assert not drained.done()
        local.engine_runs.set()
        answers = await asyncio.gather(*requests)
        assert [finished(answer, stream=bool(i % 2)) for i, answer in enumerate(answers)] == [True] * len(answers)
        assert await drained == 0
        assert server.loop.agent.in_flight == 0 and not server.loop.waiting

    run(local_ring, tokenizer, scenario)


def test_at_the_deadline_what_is_still_in_flight_ends_with_an_error_and_frees_its_slot(local_ring, tokenizer):
    async def scenario(local):
        server = local.server
        requests = await stalled_requests(local, GEOMETRY.n_slots + 1)
        started = time.monotonic()
        assert await server.drain.run() == GEOMETRY.n_slots + 1
        assert 0.4 <= time.monotonic() - started < 2
        answers = await asyncio.gather(*requests)
        for i, (status, _, body) in enumerate(answers):
            if i % 2:       # a stream has sent its 200: the error is its last event
                assert status == 200 and '"error"' in body and "drain deadline (0.4 s) passed" in body
            else:
                assert status == 503 and "drain deadline (0.4 s) passed" in json.loads(body)["error"]["message"]
        assert server.drain.in_flight == 0 and not server.loop.waiting
        local.engine_runs.set()                     # the engine finishes the cancelled slots: all come back
        await local.until(lambda: server.loop.agent.in_flight == 0)
        assert server.loop.agent.tracker.n_free == GEOMETRY.n_slots

    run(local_ring, tokenizer, scenario, drain_timeout_s=0.4)


def test_the_first_signal_drains_and_a_second_stops_at_once(local_ring, tokenizer):
    async def scenario(local):
        server, stopped = local.server, asyncio.Event()
        requests = await stalled_requests(local, 2)
        server.drain.signal(stopped.set)
        await asyncio.sleep(0.3)
        assert server.drain.draining and not stopped.is_set()
        server.drain.signal(stopped.set)
        assert stopped.is_set()
        answers = await asyncio.gather(*requests)
        assert not any(finished(answer, stream=bool(i % 2)) for i, answer in enumerate(answers))
        assert all("second SIGINT/SIGTERM" in body for _, _, body in answers)

    run(local_ring, tokenizer, scenario)


def test_a_drain_with_nothing_in_flight_stops_at_once(local_ring, tokenizer):
    async def scenario(local):
        stopped = asyncio.Event()
        local.server.drain.signal(stopped.set)
        async with asyncio.timeout(0.5):
            await stopped.wait()

    run(local_ring, tokenizer, scenario, drain_timeout_s=30)


@pytest.mark.parametrize("timeout_s", [-1, float("inf"), float("nan"), "30"])
def test_drain_config_refuses_a_timeout_that_is_not_a_finite_number_of_seconds(timeout_s):
    with pytest.raises(ValueError, match="drain timeout must be a finite number of seconds"):
        DrainConfig(timeout_s=timeout_s)


def test_a_signal_while_the_server_starts_stops_it_once_it_listens(local_ring, tokenizer, monkeypatch):
    """Ctrl-C before the listener is up (here: as ``start`` begins) is not lost: ``run`` drains and returns 0."""
    real_start = server_module.start

    async def start_after_a_signal(*args):
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.05)                    # the signal reaches the loop before the server listens
        return await real_start(*args)

    _, agent, _ = local_ring(GEOMETRY)
    server = OpenAIServer(agent, tokenizer, ServerConfig(model_name="local", drain=DrainConfig(timeout_s=30)))
    monkeypatch.setattr(server_module, "start", start_after_a_signal)
    began = time.monotonic()
    assert server_module.run(server, "127.0.0.1", 0) == 0
    assert server.drain.draining and time.monotonic() - began < 5
