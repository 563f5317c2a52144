"""The agent inside the asyncio event loop: ``AgentLoop`` (submissions, the wait queue for a full ring, the one task
that polls the ring and hands the new tokens out, the engine's health), which keeps the Prometheus ``Metrics``
(``blink.nic.metrics``). A request's outputs go to its ``Reader`` inside the poll, every request that moved in one
wake-up of the polling task (the HTTP server's streams: ``blink.nic.openai.responses``), or, for a request without
one, onto its queue for a task that awaits them (``blink.AsyncEngine``, whole answers). Invariants:

- every submitted request is closed exactly once, by its handler when it leaves (``AgentLoop.close``), whether the
  ring finished it or not (stop string, client disconnect, error); closing an unfinished request cancels its slot,
  tokens the ring still delivers for it are dropped, and the agent frees the slot once the GPU side finishes it;
- a request the ring has no free slot for waits in the agent (FIFO, at most ``LoopConfig.max_queued``); beyond
  that bound a submission raises ``Overloaded``, and whenever the engine is not serving ``EngineUnavailable``
  (HTTP turns them into 429 / 503 with ``Retry-After``); requests in flight when the engine stops serving end with
  ``EngineUnavailable`` as their last output;
- a reader is handed a request's outputs in order, from the polling task (or ``fail_all``'s caller), never after the
  one that finished it, and never after its request was closed; it must not await, and must not raise.

Nothing here knows HTTP: the OpenAI server (``blink.nic.openai``) and ``blink.AsyncEngine`` both run on it.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Protocol

from blink.errors import EngineUnavailable, EngineUnresponsive, Overloaded, RingFull
from blink.nic.agent import Agent, RequestOutput
from blink.nic.invariants import IdleInvariants
from blink.nic.metrics import Metrics
from blink.ring.control import ENGINE_STARTING
from blink.ring.request import SamplingParams

log = logging.getLogger("blink.agent")
STARTING = "the engine is still starting"     # AgentLoop.health() while the engine has not yet begun to serve


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


class Reader(Protocol):
    """Takes the outputs of the requests submitted with it, inside the poll that found them."""

    def take(self, req: Submission, item: RequestOutput | Exception) -> None:
        """``req``'s next output, or the error that ends it (``EngineUnavailable``)."""

    def flush(self) -> None:
        """Called once after the outputs one poll handed it: what they make goes out now."""


@dataclass(eq=False)
class Submission:
    """One request's life in the agent: waiting for a slot, then in the ring, then closed. Its outputs go to
    ``reader``, or, without one, onto ``queue``."""

    prompt: list[int]
    params: SamplingParams
    priority: int
    reader: Reader | None = None
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
        self.invariants = IdleInvariants(agent.tracker.n_slots, counted=agent.share.agents == 1)
        self._problem: str | None = None
        self._sampled_at = 0.0
        self._crashed: str | None = None
        self._last_poll: tuple[float, float] | None = None  # (monotonic, loop thread's CPU) of the last busy poll
        self.thread_id: int | None = None                   # the event loop thread's (native id), once it runs

    def submit(self, prompt: list[int], params: SamplingParams, priority: int,
               reader: Reader | None = None) -> Submission:
        """Queue one request for the ring, its outputs for ``reader`` (None: on its queue). ``ValueError`` naming the
        field if the ring cannot take it (nothing is queued), ``EngineUnavailable`` or ``Overloaded`` when it cannot
        take it now."""
        problem = self.health()
        if problem or self.waiting:
            # A request that cannot be valid says so first, and one that waits for a slot must be valid when its turn
            # comes; one that goes straight to the ring is checked there, once (before it claims a slot, so RingFull
            # means it was valid).
            self.agent.validate(prompt, params, priority)
        if problem:
            raise EngineUnavailable(f"{problem}: retry later", self.config.retry_after_s)
        req = Submission(prompt, params, priority, reader)
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
            self._hand_out([(req, RequestOutput(0, [], [] if req.params.logprobs else None, True, "abort",
                                                [] if req.params.top_logprobs else None))])
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
        if self._problem or self.agent.in_flight or self.waiting or self.agent.others_busy():
            self.invariants.busy()
            return
        for violation in self.invariants.check(stats, self.agent.tracker.n_free):
            log.error("an idle invariant is broken (nothing is in flight): %s", violation)
            self.metrics.invariant_violations.inc()

    async def run(self) -> None:
        self.thread_id = threading.get_native_id()
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
            self.metrics.tick()
        self._time_poll()
        try:
            outputs = self.agent.poll()
        except EngineUnresponsive as e:
            self.fail_all(str(e))
            await asyncio.sleep(self.HEARTBEAT_SAMPLE_S)
            return
        if outputs:
            self._deliver(outputs)
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One poll's outputs to their requests (those closed by their handlers are dropped: the agent frees their
        slots once the GPU side has finished them)."""
        active, handed = self._active, []
        for out in outputs:
            req = active.get(out.request_id)
            if req is None:
                continue
            self.metrics.tokens(req, len(out.new_tokens))
            if out.finished:
                del active[out.request_id]
            handed.append((req, out))
        self._hand_out(handed)

    @staticmethod
    def _hand_out(items: list[tuple[Submission, RequestOutput | Exception]]) -> None:
        """Each item to its request's reader or queue; then each reader that took any flushes, once."""
        readers = {}
        for req, item in items:
            if req.reader is None:
                req.queue.put_nowait(item)
            else:
                req.reader.take(req, item)
                readers[req.reader] = None
        for reader in readers:
            reader.flush()

    def fail_all(self, problem: str) -> None:
        """End every open request with ``problem``; their handlers report it and close them."""
        error = EngineUnavailable(f"{problem}: retry later", self.config.retry_after_s)
        if self._active or self.waiting:
            log.error("failing %d requests: %s", len(self._active) + len(self.waiting), problem)
        self._hand_out([(req, error) for req in [*self._active.values(), *self.waiting]])
