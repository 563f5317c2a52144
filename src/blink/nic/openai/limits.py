"""What a slow or greedy client may hold of the server: time to send a request's head and body, bytes of a body,
bodies being received at once, open connections.

Without these, 2,000 connections trickling their headers stayed open for a minute and 300 almost complete 1 MB
bodies doubled the agent's memory. ``ConnectionGuard`` wraps each connection's protocol: a connection that has not
delivered a whole request head ``header_timeout_s`` after it opened (or after its last response, on a kept-alive
connection) is closed, and beyond ``max_connections`` new connections are closed at once. At most
``max_pending_bodies`` bodies are being received and parsed at once (``ConnectionGuard.receiving``), which also bounds
the requests queued for the tokenizer threads; a request that finds every place taken waits for one in arrival order,
holding no more of its body than aiohttp's read buffer (it stops reading the socket beyond that). The wait and the
body share one deadline, ``body_timeout_s`` after the request head: no place by then is a 503, a place but not the
whole body (``read_body``) a 408. A burst of many small requests is therefore queued, not refused.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import http_exceptions, web

from blink.nic.openai.errors import ApiError


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    max_pending_bodies: int = 64
    max_connections: int = 4096
    keepalive_timeout_s: float = 15.0

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"HttpLimits.{name} must be in (0, 3600] seconds (got {getattr(self, name)!r})")
        for name in ("max_body_bytes", "max_pending_bodies", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HttpLimits.{name} must be a positive int (got {value!r})")


class ConnectionGuard:
    """Counts open connections and closes those that do not deliver a request head in time."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.open = 0
        self.closed_slow = 0            # connections closed for a late request head
        self.refused = 0                # connections closed at once: too many open
        self._timers: dict[object, asyncio.TimerHandle] = {}
        self._bodies = asyncio.Semaphore(limits.max_pending_bodies)

    def protocol(self, inner) -> GuardedProtocol:
        return GuardedProtocol(inner, self)

    @asynccontextmanager
    async def receiving(self, deadline: float):
        """Hold one of the ``max_pending_bodies`` places for a body being received and parsed, waiting for one in
        arrival order until ``deadline`` (the event loop's clock); 503 if none came by then."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._bodies.acquire()
        except TimeoutError:
            raise ApiError(503, f"all {self.limits.max_pending_bodies} places for a request body being received were "
                                f"taken for {self.limits.body_timeout_s:.0f} s: retry later", retry_after_s=1) from None
        try:
            yield
        finally:
            self._bodies.release()

    def head_received(self, transport) -> None:
        """The middleware saw a whole request head on ``transport``: its clock stops until the response is out."""
        timer = self._timers.pop(transport, None)
        if timer is not None:
            timer.cancel()

    def response_done(self, transport) -> None:
        """A response went out; a kept-alive connection must send its next head in time too."""
        if transport is not None and not transport.is_closing():
            self._arm(transport)

    def _arm(self, transport) -> None:
        self.head_received(transport)
        self._timers[transport] = asyncio.get_running_loop().call_later(
            self.limits.header_timeout_s, self._too_slow, transport)

    def _too_slow(self, transport) -> None:
        self._timers.pop(transport, None)
        self.closed_slow += 1
        transport.close()

    def _opened(self, transport) -> bool:
        if self.open >= self.limits.max_connections:
            self.refused += 1
            transport.close()
            return False
        self.open += 1
        self._arm(transport)
        return True

    def _closed(self, transport) -> None:
        self.head_received(transport)
        self.open -= 1


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's per-connection protocol, seen through the guard (every callback is passed on)."""

    def __init__(self, inner, guard: ConnectionGuard):
        self.inner, self.guard = inner, guard
        self._counted = False

    def connection_made(self, transport) -> None:
        self._counted = self.guard._opened(transport)
        if self._counted:
            self.inner.connection_made(transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._counted:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self._counted else None

    def connection_lost(self, exc) -> None:
        if self._counted:
            self.guard._closed(self._transport)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def read_body(request, limits: HttpLimits, deadline: float) -> bytes:
    """The request's body, received by ``deadline`` (the event loop's clock: ``body_timeout_s`` after the request
    head) and within the size limit (413 / 408 / 400 with what to do)."""
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise ApiError(413, f"the request body is {request.content_length} bytes; at most {limits.max_body_bytes} "
                            "are accepted")
    try:
        async with asyncio.timeout_at(deadline):
            return await request.read()
    except web.RequestPayloadError as e:
        encoding = request.headers.get("Content-Encoding")
        raise ApiError(400, f"the request body could not be read ({' '.join(str(e).split())}): send it plain" +
                       (f", or as valid {encoding}" if encoding else "")) from None
    except TimeoutError:
        # aiohttp closes the connection after the answer: the rest of the body was never read.
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:.0f} s") from None


class OneLineBadRequests(logging.Filter):
    """aiohttp logs each malformed request with a traceback; a client's bad bytes are worth one line, not ten."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (http_exceptions.BadHttpMessage,
                                                               web.RequestPayloadError)):
            record.msg = f"{record.getMessage()}: {type(record.exc_info[1]).__name__}: " \
                         f"{' '.join(str(record.exc_info[1]).split())}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True
