"""``/livez``, ``/readyz`` and the load gauges of ``/metrics`` (``blink.nic.openai.health``) over HTTP, the engine
being the reference consumer stepped in the server's own loop (``local.py``): starting, serving, stalled, in a long
step, full, draining. ``/health`` keeps its meaning throughout."""
import asyncio

import numpy as np
import pytest

from blink.ring import control
from tests.nic.openai.local import GEOMETRY, finished, run_local as run


def test_while_the_engine_starts_the_server_is_live_not_ready_and_refuses_requests(local_ring, tokenizer):
    async def scenario(local):
        assert await local.get("/livez") == (200, {"status": "live"})
        assert await local.get("/readyz") == (503, {"status": "starting", "reason": "the engine is still starting"})
        status, headers, _ = await local.complete()
        assert status == 503 and headers["Retry-After"] == "1"
        assert (await local.get("/health"))[0] == 503
        assert (await local.metrics())["blink_ready"] == 0
        local.serve()
        await asyncio.sleep(0.15)                   # the loop samples the engine's state every 100 ms
        assert await local.get("/readyz") == (200, {"status": "ready"})
        assert await local.get("/health") == (200, {"status": "ok"})
        assert finished(await local.complete())
        assert (await local.metrics())["blink_ready"] == 1

    run(local_ring, tokenizer, scenario)


@pytest.mark.parametrize("max_queued", [0, 2])
def test_not_ready_exactly_when_the_next_request_would_get_429(local_ring, tokenizer, max_queued):
    """Every slot busy and ``max_queued`` waiting in the agent: /readyz says "full" and the next request gets 429;
    one request fewer and it is ready. The stalled engine then serves them all."""
    async def scenario(local):
        local.serve()
        await asyncio.sleep(0.15)
        local.engine_runs.clear()
        server = local.server
        capacity = GEOMETRY.n_slots + max_queued
        requests = [asyncio.create_task(local.complete()) for _ in range(capacity - 1)]
        await local.until(lambda: server.drain.in_flight == capacity - 1 and server.loop.agent.in_flight)
        assert (await local.get("/readyz"))[0] == 200
        requests.append(asyncio.create_task(local.complete()))
        await local.until(lambda: server.drain.in_flight == capacity)
        await local.until(lambda: len(server.loop.waiting) == max_queued and server.loop.agent.tracker.n_free == 0)
        status, body = await local.get("/readyz")
        assert status == 503 and body["status"] == "full" and "429" in body["reason"]
        gauges = await local.metrics()
        assert gauges["blink_ready"] == 0 and gauges["blink_ring_free_slots"] == 0
        assert gauges["blink_ring_slots"] == GEOMETRY.n_slots and gauges["blink_requests_max_queued"] == max_queued
        assert gauges["blink_requests_queued"] == max_queued
        assert gauges["blink_http_requests_in_flight"] == capacity
        assert (await local.complete())[0] == 429
        assert await local.get("/livez") == (200, {"status": "live"})    # full is not dead
        local.engine_runs.set()
        answers = await asyncio.gather(*requests)
        assert all(map(finished, answers))
        assert (await local.get("/readyz"))[0] == 200

    run(local_ring, tokenizer, scenario, max_queued=max_queued)


def test_liveness_fails_when_the_heartbeat_stops_but_not_inside_a_long_step(local_ring, tokenizer):
    async def scenario(local):
        local.serve()
        await asyncio.sleep(0.15)
        local.engine_runs.clear()                   # the GPU loop stalls
        await asyncio.sleep(0.8)
        status, body = await local.get("/livez")
        assert status == 503 and body["status"] == "dead" and "heartbeat has been stuck" in body["reason"]
        assert (await local.get("/readyz"))[1]["status"] == "unhealthy"
        local.engine_runs.set()
        await asyncio.sleep(0.15)
        assert (await local.get("/livez"))[0] == 200 and (await local.get("/readyz"))[0] == 200
        # A model step on the CPU can take longer than the liveness timeout: the engine says it is inside one.
        control.write(local.memory, "step_limit_s", 30)
        control.write(local.memory, "in_step", 1)
        local.engine_runs.clear()
        await asyncio.sleep(0.8)
        assert await local.get("/livez") == (200, {"status": "live"})
        assert (await local.get("/readyz"))[0] == 200
        control.write(local.memory, "in_step", 0)
        local.engine_runs.set()

    run(local_ring, tokenizer, scenario, liveness_timeout_s=0.5)


def test_while_draining_only_readiness_changes(local_ring, tokenizer):
    async def scenario(local):
        local.serve()
        await asyncio.sleep(0.15)
        drained = asyncio.create_task(local.server.drain.run())
        await asyncio.sleep(0)
        assert await local.get("/readyz") == (503, {"status": "draining", "reason": "the server is draining "
                                                    "(shutting down): new requests get 503"})
        assert await local.get("/livez") == (200, {"status": "live"})
        assert await local.get("/health") == (200, {"status": "ok"})
        gauges = await local.metrics()
        assert gauges["blink_draining"] == 1 and gauges["blink_ready"] == 0
        assert await drained == 0

    run(local_ring, tokenizer, scenario)


def test_pending_is_what_waits_in_the_ring_and_in_the_agent(local_ring, tokenizer):
    """``blink_requests_pending`` (vLLM's num_requests_waiting) = ring ``waiting`` + agent ``queued``; the KV gauges
    are the control block's words."""
    async def scenario(local):
        local.serve()
        await asyncio.sleep(0.15)
        local.engine_runs.clear()
        local.consumer.max_running = 1              # one runs, the other ring slots wait for admission
        requests = [asyncio.create_task(local.complete()) for _ in range(GEOMETRY.n_slots + 1)]
        await local.until(lambda: local.server.loop.agent.tracker.n_free == 0 and local.server.loop.waiting)
        local.consumer.step()                       # admits one, publishes running / waiting
        control.write(local.memory, "kv_pages_total", 64)
        control.write(local.memory, "kv_pages_free", 40)
        gauges = await local.metrics()
        assert gauges["blink_requests_running"] == 1 and gauges["blink_requests_waiting"] == GEOMETRY.n_slots - 1
        assert gauges["blink_requests_pending"] == GEOMETRY.n_slots - 1 + 1
        assert gauges["blink_kv_cache_free_pages"] == 40 and gauges["blink_kv_cache_pages"] == 64
        assert gauges["blink_kv_cache_usage_ratio"] == 1 - 40 / 64
        local.engine_runs.set()
        assert all(map(finished, await asyncio.gather(*requests)))

    run(local_ring, tokenizer, scenario)



def test_a_server_whose_agent_loop_crashed_stops_with_exit_code_1(local_ring, tokenizer):
    """Issue 38 #9: another writer on the ring (a second agent) changed a slot's epoch under the agent; its loop
    crashed, and the process answered 503 for ever. Now the request in flight ends with an error and the server
    stops with exit code 1, for its supervisor to restart it, as when its engine is gone."""
    async def scenario(local):
        local.serve()
        await asyncio.sleep(0.15)
        local.engine_runs.clear()                   # the request stays in the ring while the other writer acts
        request = asyncio.create_task(local.complete(max_tokens=8))
        agent = local.server.loop.agent
        await local.until(lambda: agent.in_flight == 1)
        (slot,) = agent._slot_of.values()
        local.memory.write(agent.layout.status_at("epoch", slot), np.array([12345], "<u4").tobytes())
        local.engine_runs.set()
        async with asyncio.timeout(10):
            await local.server.stopped.wait()
        assert local.server.exit_code == 1
        status, _, body = await request
        assert status == 503 and "the agent loop crashed" in body

    run(local_ring, tokenizer, scenario)
