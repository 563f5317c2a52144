"""The agent inside the asyncio event loop: ``AgentLoop`` (submissions, the wait queue for a full ring, the one task
that polls the ring and fans the new tokens out to per-request queues, the engine's health) and the Prometheus
``Metrics`` it keeps. Invariants:

- every submitted request is closed exactly once, by its handler when it leaves (``AgentLoop.close``), whether the
  ring finished it or not (stop string, client disconnect, error); closing an unfinished request cancels its slot,
  tokens the ring still delivers for it are dropped, and the agent frees the slot once the GPU side finishes it;
- a request the ring has no free slot for waits in the agent (FIFO, at most ``LoopConfig.max_queued``); beyond
  that bound a submission raises ``Overloaded``, and whenever the engine is not serving ``EngineUnavailable``
  (HTTP turns them into 429 / 503 with ``Retry-After``); requests in flight when the engine stops serving end with
  ``EngineUnavailable`` on their queue.

Nothing here knows HTTP: the OpenAI server (``blink.nic.openai``) and ``blink.AsyncEngine`` both run on it.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blink.errors import EngineUnavailable, EngineUnresponsive, Overloaded, RingFull
from blink.nic.agent import Agent, RequestOutput
from blink.ring.control import ENGINE_STARTING
from blink.ring.request import SamplingParams

log = logging.getLogger("blink.agent")
STARTING = "the engine is still starting"     # AgentLoop.health() while the engine has not yet begun to serve
# Two ring polls this far apart while requests are in flight held their tokens back by most of a decode step (5-20 ms
# on 8B models): a stall of the agent, which every stream in flight feels at once.
STALL_S = 5e-3


@dataclass(frozen=True)
class LoopConfig:
    """``max_queued``: requests that may wait in the agent for a free ring slot; more raise ``Overloaded``.
    ``poll_interval_s``: pause between polls while requests are in flight and the last poll found nothing: a sleep,
    not a spin. The event loop's timers have millisecond resolution (epoll; libuv under uvloop): below 1 ms asyncio
    sleeps 1 ms anyway, and uvloop would not sleep at all. ``retry_after_s``: the retry hint of ``Overloaded`` and
    ``EngineUnavailable``. Whether the engine serves is the agent's ``Liveness`` (its ``liveness_timeout_s``).
    """

    max_queued: int = 1024
    poll_interval_s: float = 1e-3
    retry_after_s: int = 1

    def __post_init__(self):
        if not isinstance(self.max_queued, int) or self.max_queued < 0:
            raise ValueError(f"LoopConfig.max_queued must be an int >= 0 (got {self.max_queued!r})")
        if not 0 <= self.poll_interval_s <= 1:
            raise ValueError(f"LoopConfig.poll_interval_s must be in [0, 1] seconds (got {self.poll_interval_s!r})")
        if not isinstance(self.retry_after_s, int) or self.retry_after_s < 1:
            raise ValueError(f"LoopConfig.retry_after_s must be an int >= 1 (got {self.retry_after_s!r})")


@dataclass(eq=False)
class Submission:
    """One request's life in the agent: waiting for a slot, then in the ring, then closed."""

    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # RequestOutputs, or an error that ends it
    request_id: int | None = None       # set once the ring has it
    last_token_at: float | None = None
    finish_reason: str | None = None    # what the client was told, once it was
    closed: bool = False


class AgentLoop:
    """Owns the Agent inside the event loop: submissions, the wait queue for a full ring, and the polling task."""

    HEARTBEAT_SAMPLE_S = 0.1

    def __init__(self, agent: Agent, metrics: Metrics, config: LoopConfig = LoopConfig()):
        self.agent, self.metrics, self.config = agent, metrics, config
        self.waiting: deque[Submission] = deque()       # the ring was full: FIFO, at most config.max_queued
        self._active: dict[int, Submission] = {}        # request id -> request whose outputs someone awaits
        self._wakeup = asyncio.Event()
        self._problem: str | None = None
        self._sampled_at = 0.0
        self._crashed: str | None = None
        self._last_poll: tuple[float, float] | None = None  # (monotonic, loop thread's CPU) of the last busy poll

    def submit(self, prompt: list[int], params: SamplingParams, priority: int) -> Submission:
        """Queue one request for the ring. ``ValueError`` naming the field if the ring cannot take it (nothing is
        queued), ``EngineUnavailable`` or ``Overloaded`` when it cannot take it now."""
        problem = self.health()
        if problem or self.waiting:
            # A request that cannot be valid says so first, and one that waits for a slot must be valid when its turn
            # comes; one that goes straight to the ring is checked there, once (before it claims a slot, so RingFull
            # means it was valid).
            self.agent.validate(prompt, params, priority)
        if problem:
            raise EngineUnavailable(f"{problem}: retry later", self.config.retry_after_s)
        req = Submission(prompt, params, priority)
        if self.waiting or not self._to_ring(req):
            if len(self.waiting) >= self.config.max_queued:
                raise Overloaded(f"the server is at capacity ({self.agent.in_flight} requests in the ring, "
                                 f"{len(self.waiting)} queued): retry later", self.config.retry_after_s)
            self.waiting.append(req)
        self.metrics.prompt_tokens.inc(len(prompt))
        self._wakeup.set()
        return req

    def close(self, req: Submission) -> None:
        """The handler is done with ``req``; if the ring has not finished it, cancel it. Idempotent."""
        if req.closed:
            return
        req.closed = True
        if req.request_id is None:
            with suppress(ValueError):      # already taken out by cancel()
                self.waiting.remove(req)
        elif self._active.pop(req.request_id, None) is not None:
            self.agent.cancel(req.request_id)
        self.metrics.finished(req, req.finish_reason or "abort")

    def cancel(self, req: Submission) -> None:
        """Ask the engine to finish ``req`` with "abort"; its queue then ends with that finish reason."""
        if req.closed or req.finish_reason is not None:
            return
        if req.request_id is None:
            self.waiting.remove(req)
            req.queue.put_nowait(RequestOutput(0, [], [] if req.params.logprobs else None, True, "abort"))
        else:
            self.agent.cancel(req.request_id)

    def health(self) -> str | None:
        """Why the engine cannot serve now, or None when it can (sampled at most every HEARTBEAT_SAMPLE_S)."""
        if self._crashed:
            return self._crashed
        if time.monotonic() - self._sampled_at > self.HEARTBEAT_SAMPLE_S:
            self._sample()
        return self._problem

    def _sample(self) -> None:
        stats = self.agent.stats()
        self._sampled_at = time.monotonic()
        if stats["engine_state"] == ENGINE_STARTING and not stats["launch_error"]:
            self._problem = STARTING
        else:
            self._problem = self.agent.liveness.problem(stats, self._sampled_at)

    async def run(self) -> None:
        gc.callbacks.append(self.metrics.gc_phase)
        try:
            while True:
                await self._iterate()
        except Exception as e:
            log.exception("the agent loop crashed")
            self._crashed = f"the agent loop crashed ({e!r})"
            self.fail_all(self._crashed)
            raise
        finally:
            gc.callbacks.remove(self.metrics.gc_phase)

    async def _iterate(self) -> None:
        if not self.agent.in_flight and not self.waiting:
            self._last_poll = None      # the idle wait below is not a stall
            # Idle: sleep until a submission, waking now and then to keep the heartbeat sample fresh.
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that arrives as the wait
            # ends, and this task then never stops.
            with suppress(TimeoutError):
                async with asyncio.timeout(self.HEARTBEAT_SAMPLE_S):
                    await self._wakeup.wait()
            self._wakeup.clear()
        if time.monotonic() - self._sampled_at > self.HEARTBEAT_SAMPLE_S:
            self._sample()
        self._time_poll()
        try:
            outputs = self.agent.poll()
        except EngineUnresponsive as e:
            self.fail_all(str(e))
            await asyncio.sleep(self.HEARTBEAT_SAMPLE_S)
            return
        for out in outputs:
            self._deliver(out)
        while self.waiting and self._to_ring(self.waiting[0]):
            self.waiting.popleft()
        await asyncio.sleep(0 if outputs else self.config.poll_interval_s)

    def _time_poll(self) -> None:
        """The time since the previous poll with requests in flight, and how much of it this thread was off the CPU
        (its sleeps, and waits for a core), into the metrics."""
        now = (time.monotonic(), time.thread_time())
        if self._last_poll is not None:
            wall = now[0] - self._last_poll[0]
            self.metrics.poll_gap(wall, wall - (now[1] - self._last_poll[1]))
        self._last_poll = now

    def _to_ring(self, req: Submission) -> bool:
        """Submit ``req`` to the ring; False if no slot is free."""
        try:
            req.request_id = self.agent.submit(req.prompt, req.params, priority=req.priority)
        except RingFull:
            return False
        self._active[req.request_id] = req
        return True

    def _deliver(self, out: RequestOutput) -> None:
        req = self._active.get(out.request_id)
        if req is None:
            return      # closed by its handler; the agent frees the slot once the GPU side has finished it
        self.metrics.tokens(req, len(out.new_tokens))
        req.queue.put_nowait(out)
        if out.finished:
            del self._active[out.request_id]

    def fail_all(self, problem: str) -> None:
        """End every open request with ``problem``; their handlers report it and close them."""
        error = EngineUnavailable(f"{problem}: retry later", self.config.retry_after_s)
        for req in [*self._active.values(), *self.waiting]:
            req.queue.put_nowait(error)

# -- metrics -------------------------------------------------------------------------------------------------------

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, STALL_S, 0.01, 0.02, 0.05, 0.1, 0.5)


class Metrics:
    """Prometheus metrics: the agent's own timings and counters, the ring's control block read at scrape time, and
    the agent process's CPU time and memory (``process_*``: what ``blink bench serve`` meters per 1,000 tokens)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.ttft = Histogram("blink_time_to_first_token_seconds", "From submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("blink_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("blink_e2e_request_latency_seconds", "From submission to the end of the request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # The HTTP server's share besides the ring's: from a streamed request's headers to its first token's chunk
        # written (body, parsing, tokenization and the chunk's write on top of blink_time_to_first_token_seconds).
        self.http_ttft = Histogram("blink_http_time_to_first_chunk_seconds",
                                   "From a streamed request's arrival at the HTTP server to its first token's chunk "
                                   "written", buckets=_LATENCY_BUCKETS, registry=r)
        # Where the agent's own pauses go: the gaps of STALL_S or more between its ring polls while requests are in
        # flight (their time, and the part its event loop's thread was off the CPU), and Python's GC passes. Only
        # the stalls are counted: a histogram of every gap would cost each poll, the agent's hot path, its update.
        self.stalls = Counter("blink_agent_stalls", f"Ring polls {STALL_S * 1e3:g} ms or more after the previous one "
                              "with requests in flight", registry=r)
        self.stall_seconds = Counter("blink_agent_stall_seconds", "Time between the polls of those stalls",
                                     registry=r)
        self.stall_off_cpu_seconds = Counter("blink_agent_stall_off_cpu_seconds", "Of the stalls' time, the part the "
                                             "agent's event loop thread was not running (sleeps, waits for a core)",
                                             registry=r)
        gc_pauses = Histogram("blink_agent_gc_pause_seconds", "Python's cyclic garbage collection passes in the "
                              "agent process", ["generation"], buckets=_GC_BUCKETS, registry=r)
        self._gc_pauses = [gc_pauses.labels(generation=str(g)) for g in range(3)]
        self._gc_started: float | None = None
        self.prompt_tokens = Counter("blink_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.requests = Counter("blink_requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)

    def watch(self, loop: AgentLoop) -> None:
        self.registry.register(_RingCollector(loop))

    def tokens(self, req: Submission, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if req.last_token_at is None:
            self.ttft.observe(now - req.arrival)
        else:
            # Tokens that arrive in one poll share the gap since the previous poll's tokens.
            for _ in range(n):
                self.itl.observe((now - req.last_token_at) / n)
        req.last_token_at = now

    def poll_gap(self, wall: float, off_cpu: float) -> None:
        """The time between two polls with requests in flight, ``off_cpu`` of it with the loop's thread not running;
        counted if it is a stall."""
        if wall >= STALL_S:
            self.stalls.inc()
            self.stall_seconds.inc(wall)
            self.stall_off_cpu_seconds.inc(max(off_cpu, 0.0))   # the two clocks are read a few ns apart

    def gc_phase(self, phase: str, info: dict) -> None:
        """A ``gc.callbacks`` entry: times each collection from its start to its stop."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_pauses[info["generation"]].observe(time.perf_counter() - self._gc_started)
            self._gc_started = None

    def finished(self, req: Submission, reason: str) -> None:
        self.e2e.observe(time.monotonic() - req.arrival)
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RingCollector:
    """Gauges and counters the GPU side keeps in the ring's control block, plus the agent's wait queue."""

    def __init__(self, loop: AgentLoop):
        self.loop = loop

    def collect(self):
        s = self.loop.agent.stats()
        gauges = {"blink_requests_running": ("Requests the engine is running", s["running"]),
                  "blink_requests_waiting": ("Requests in the ring not yet admitted", s["waiting"]),
                  "blink_requests_queued": ("Requests waiting in the agent for a free ring slot",
                                            len(self.loop.waiting)),
                  "blink_kv_cache_usage_ratio": ("Fraction of KV-cache pages in use",
                                                 1 - s["kv_pages_free"] / s["kv_pages_total"]
                                                 if s["kv_pages_total"] else 0.0),
                  "blink_prefix_cache_pages": ("KV pages in the prefix cache, in use or evictable", s["cached_pages"]),
                  "blink_prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache per prompt token looked up",
                                                  s["prefix_hit_tokens"] / s["prefix_query_tokens"]
                                                  if s["prefix_query_tokens"] else 0.0)}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {"blink_generation_tokens": ("Tokens generated by the engine", s["tokens"]),
                    "blink_preemptions": ("Recompute preemptions", s["preempted"]),
                    "blink_engine_steps": ("Model steps launched", s["steps"]),
                    "blink_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                                   s["prefix_query_tokens"]),
                    "blink_prefix_cache_hits": ("Prompt tokens found in the prefix cache", s["prefix_hit_tokens"]),
                    "blink_prefix_cache_evictions": ("Cached KV pages evicted for reuse", s["prefix_evictions"]),
                    "blink_prefill_tokens": ("Prompt tokens the model computed (cache hits excluded)",
                                             s["prefill_tokens"])}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
