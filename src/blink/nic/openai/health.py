"""What an orchestrator and a router read from a replica: liveness (``GET /livez``), readiness (``GET /readyz``) and
the load gauges of ``/metrics`` (``LoadGauges``). docs/deploy.md documents them for users; the semantics:

- **live** unless the agent's loop crashed or the engine is dead by ``blink.nic.liveness`` (a launch error, stopped,
  its process stopped ticking, or its heartbeat stood still for ``--liveness-timeout`` outside a model step, for the
  step limit inside one: a long CPU step is not death). Live while the engine starts and while the server drains:
  restarting either would only lose work. 200 ``{"status": "live"}``, else 503 ``{"status": "dead", "reason"}``.
- **ready** when a new request would be taken now: not while the engine starts (``starting``), while the server
  drains (``draining``), while the engine is not serving (``unhealthy``: what ``/health`` reports), or while every
  ring slot is busy and the agent's wait queue holds ``--max-queued`` requests (``full``: the next request would get
  429). 200 ``{"status": "ready"}``, else 503 ``{"status": STATE, "reason"}``.

Neither probe sends ``Retry-After`` or an OpenAI error body: they are for machines that only read the status code;
``reason`` is for the humans reading their logs.
"""
from __future__ import annotations

from aiohttp import web

from blink.nic.agent_loop import STARTING, AgentLoop
from blink.nic.drain import Drain
from blink.nic.metrics import Metrics


class Probes:
    """Liveness and readiness of one server: its agent loop (and so the engine behind the ring) and its drain."""

    def __init__(self, loop: AgentLoop, drain: Drain):
        self.loop, self.drain = loop, drain

    def dead(self) -> str | None:
        """Why this server should be restarted, or None."""
        problem = self.loop.health()
        return None if problem == STARTING else problem

    def not_ready(self) -> tuple[str, str] | None:
        """``(state, reason)`` while a new request would be refused, or None when it would be taken."""
        if self.drain.draining:
            return "draining", "the server is draining (shutting down): new requests get 503"
        problem = self.loop.health()
        if problem is not None:
            return ("starting" if problem == STARTING else "unhealthy"), problem
        if self.full():
            return "full", (f"every ring slot is busy and {len(self.loop.waiting)} requests wait in the agent (at "
                            "--max-queued): new requests get 429")
        return None

    def full(self) -> bool:
        """A submission now would get ``Overloaded``: the ring has no free slot (or requests already wait for one)
        and the wait queue is at ``LoopConfig.max_queued`` (``AgentLoop.submit``'s refusal)."""
        waiting = self.loop.waiting
        no_slot = bool(waiting) or self.loop.agent.tracker.n_free == 0
        return no_slot and len(waiting) >= self.loop.config.max_queued

    async def live(self, request: web.Request) -> web.Response:
        reason = self.dead()
        if reason is None:
            return web.json_response({"status": "live"})
        return web.json_response({"status": "dead", "reason": reason}, status=503)

    async def ready(self, request: web.Request) -> web.Response:
        refusal = self.not_ready()
        if refusal is None:
            return web.json_response({"status": "ready"})
        state, reason = refusal
        return web.json_response({"status": state, "reason": reason}, status=503)

    def routes(self) -> list:
        return [web.get("/livez", self.live), web.get("/readyz", self.ready)]


class LoadGauges:
    """The gauges a least-load or KV-aware router picks a replica by that this process keeps (its requests, its
    slots, its readiness), published into ``metrics`` (``Metrics.publish``: summed over the agent processes where
    several serve); the ring's, ``blink_requests_pending``, ``blink_kv_cache_*`` and ``blink_ring_slots`` among them,
    come from ``blink.nic.engine_metrics``, and ``blink_requests_queued`` from ``blink.nic.metrics``."""

    GAUGES = [  # name, help, how the processes' values make one
        ("blink_requests_max_queued", "Requests that may wait in the agent for a ring slot (--max-queued)", "livesum"),
        ("blink_http_requests_in_flight", "Generation requests taken and not yet answered (what a drain waits for)",
         "livesum"),
        ("blink_ring_free_slots", "Ring request slots free for a new request", "livesum"),
        ("blink_ready", "Agent processes whose /readyz answers 200 (one process: 1 while it does, else 0)", "livesum"),
        ("blink_draining", "1 from the first SIGTERM / SIGINT on, else 0", "livemax")]

    def __init__(self, probes: Probes, metrics: Metrics):
        self.probes = probes
        self.gauges = [metrics.gauge(name, doc, mode) for name, doc, mode in self.GAUGES]
        metrics.publishing(self.publish)

    def publish(self) -> None:
        loop, drain = self.probes.loop, self.probes.drain
        values = (loop.config.max_queued, drain.in_flight, loop.agent.tracker.n_free,
                  int(self.probes.not_ready() is None), int(drain.draining))
        for gauge, value in zip(self.gauges, values, strict=True):
            gauge.set(value)
