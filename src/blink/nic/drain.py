"""Graceful drain of the agent's server on SIGTERM / SIGINT: stop taking requests, finish the ones in flight up to a
deadline, then stop.

``Drain`` counts the requests the server has taken and not yet answered (``admit``) and runs the drain. Invariants:

- ``in_flight`` is the number of requests inside ``admit()``: taken before the drain began, not yet answered (being
  read or tokenized, waiting in the agent for a ring slot, in the ring, streaming);
- once the drain has begun nothing ends it: every later ``admit()`` raises ``EngineUnavailable`` (HTTP 503 with
  ``Retry-After``; nothing was queued, so a router may send the request to another replica);
- the drain ends when ``in_flight`` is 0, or at ``DrainConfig.timeout_s``: then every request still in the agent
  ends with ``EngineUnavailable`` (a 503, or an error event in a stream that has begun), and the server stops; one
  still being read or tokenized then is cut when the server closes its connections, ``ABORT_GRACE_S`` later;
- a second signal during the drain does the same at once.

Either way the server's exit code stays 0: it was asked to stop and it stopped (1 is kept for an engine that is gone).
Nothing here knows HTTP; ``blink.nic.openai.server`` gates its POST requests with ``admit`` and gives the signals to
``signal``.
"""
from __future__ import annotations

import asyncio
import logging
import math
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Callable

from blink.errors import EngineUnavailable
from blink.nic.agent_loop import AgentLoop

log = logging.getLogger("blink.server")
# Once a drain has ended (deadline, second signal): how long the requests it ended with an error get to send that
# error before their connections are closed.
ABORT_GRACE_S = 2.0


@dataclass(frozen=True)
class DrainConfig:
    """``timeout_s``: how long a drain waits for the requests in flight (queued ones included) before it ends the
    rest with an error (``--drain-timeout``). Keep an orchestrator's grace period above it (docs/deploy.md)."""

    timeout_s: float = 30.0

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and 0 <= self.timeout_s and math.isfinite(self.timeout_s)):
            raise ValueError(f"the drain timeout must be a finite number of seconds >= 0 (got {self.timeout_s!r})")


class Drain:
    """The requests a server has taken and not answered, and the drain of them (see the module's invariants)."""

    def __init__(self, loop: AgentLoop, config: DrainConfig = DrainConfig()):
        self.loop, self.config = loop, config
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None

    @contextmanager
    def admit(self):
        """Count one request while it is served; ``EngineUnavailable`` (nothing counted) once the drain has begun."""
        if self.draining:
            raise EngineUnavailable("the server is draining (shutting down): send the request to another replica, or "
                                    "retry later", self.loop.config.retry_after_s)
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    def signal(self, stop: Callable[[], None]) -> None:
        """SIGINT / SIGTERM (from the event loop): the first starts the drain, which calls ``stop()`` when it ends; a
        second ends what is in flight with an error and calls ``stop()`` at once."""
        if self._task is None:
            self._task = asyncio.create_task(self._drain_then(stop))
            return
        log.warning("second signal: stopping at once; %d requests in flight end with an error", self.in_flight)
        self.loop.fail_all("the server was stopped at once (a second SIGINT/SIGTERM) before this request finished")
        stop()

    async def run(self) -> int:
        """Drain: refuse new requests from now on, wait for the ones in flight up to the deadline, then end the rest
        with an error. Returns the number of requests that were still in flight at the deadline."""
        self.draining = True
        timeout_s = self.config.timeout_s
        log.info("draining: %d requests in flight, up to %g s (new requests get 503)", self.in_flight, timeout_s)
        with suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        left = self.in_flight
        if left:
            log.warning("drain deadline (%g s): %d requests still in flight end with an error", timeout_s, left)
            self.loop.fail_all(f"the server shut down: its drain deadline ({timeout_s:g} s) passed before this request "
                               "finished")
        else:
            log.info("drained: every request in flight has finished")
        return left

    async def _drain_then(self, stop: Callable[[], None]) -> None:
        try:
            await self.run()
        finally:
            stop()
