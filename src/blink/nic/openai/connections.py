"""What a connection may hold of the server before its request reaches a handler: time and bytes of a request head,
and a place among ``max_connections``; and aiohttp's own errors (malformed HTTP) in OpenAI's error JSON.

``GuardedProtocol`` wraps aiohttp's per-connection protocol and reads the bytes before aiohttp does: a request head
(request line and headers, up to its blank line) must arrive within ``header_timeout_s`` of its first byte (of the
connection opening, for the first one) and within ``max_head_bytes``, else the connection is closed (431 in OpenAI
JSON for a head too large). aiohttp alone let a head grow to 128 headers of 8 KB: 1,000 unfinished ~1 MB heads took
the agent from 0.6 to 2.0 GB. A kept-alive connection waiting for its next request is aiohttp's to close, after
``keepalive_timeout_s``. Beyond ``max_connections`` new connections are closed at once.
"""
from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

from aiohttp import web_protocol
from aiohttp.http_exceptions import ContentEncodingError

from blink.nic.openai.errors import ApiError
from blink.nic.openai.limits import DECODABLE, HttpLimits, one_line

HEAD_END = b"\r\n\r\n"


class ConnectionGuard:
    """Counts open connections and the ones it closed, and holds each connection's limits."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.open = 0
        self.closed_slow = 0            # connections closed for a late request head
        self.closed_big = 0             # connections closed for a request head beyond max_head_bytes
        self.refused = 0                # connections closed at once: too many open
        self._protocols: dict[object, GuardedProtocol] = {}

    def protocol(self, inner) -> GuardedProtocol:
        return GuardedProtocol(inner, self)

    def response_done(self, transport) -> None:
        """A response went out on ``transport``: its next bytes start the next request head."""
        protocol = self._protocols.get(transport)
        if protocol is not None:
            protocol.await_head()


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's per-connection protocol, seen through the guard (every callback is passed on). Between a response
    and the first byte of the next head the connection is idle (no clock of the guard's runs); from that byte until
    the head's blank line it counts the head's bytes and time; then, until the response is out, it passes bytes on."""

    def __init__(self, inner, guard: ConnectionGuard):
        self.inner, self.guard = inner, guard
        self._transport = None
        self._timer: asyncio.TimerHandle | None = None
        self._head: int | None = 0      # bytes of the head so far; None while a request is being served
        self._refused = False           # answered 431: later bytes are dropped until the connection closes
        self._tail = b""                # the last bytes of the head so far: its end may straddle two reads

    def connection_made(self, transport) -> None:
        limits = self.guard.limits
        if self.guard.open >= limits.max_connections:
            self.guard.refused += 1
            transport.close()
            return
        self.guard.open += 1
        self._transport = transport
        self.guard._protocols[transport] = self
        self._arm()                     # a new connection owes its first head from now on
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._refused:
            return
        if self._head is not None and not self._take_head(data):
            return
        self.inner.data_received(data)

    def await_head(self) -> None:
        """The response is out: the next byte begins the next head (its clock starts then)."""
        self._disarm()
        self._head, self._tail = 0, b""

    def _take_head(self, data: bytes) -> bool:
        """Count ``data`` into the head; False if it made the head too large (the connection is then closed)."""
        if self._timer is None:
            self._arm()                 # the first byte of a kept-alive connection's next head
        seen = self._tail + data
        end = seen.find(HEAD_END)
        size = self._head + (len(data) if end < 0 else end + len(HEAD_END) - len(self._tail))
        limit = self.guard.limits.max_head_bytes
        if size > limit:
            self.guard.closed_big += 1
            self._refuse(ApiError(431, f"the request head (request line and headers) is over {limit} bytes: send "
                                       "fewer or shorter headers"))
            return False
        if end < 0:
            self._head, self._tail = size, seen[-(len(HEAD_END) - 1):]
        else:
            self._head, self._tail = None, b""
            self._disarm()
        return True

    def _refuse(self, error: ApiError) -> None:
        """Answer ``error`` and end the connection's sending side; what the client still sends is dropped until it
        closes or the head's clock runs out (closing at once, with its bytes unread, would reset the connection
        and could lose the answer)."""
        self._refused = True
        body = json.dumps(error.body()).encode()
        self._transport.write(f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
                              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                              "Connection: close\r\n\r\n".encode() + body)
        self._transport.write_eof()

    def _arm(self) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(self.guard.limits.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        self.guard.closed_slow += 1
        self._transport.close()

    def eof_received(self):
        if self._refused:
            return False                # closes the connection
        return self.inner.eof_received() if self._transport is not None else None

    def connection_lost(self, exc) -> None:
        if self._transport is not None:
            self._disarm()
            self.guard.open -= 1
            self.guard._protocols.pop(self._transport, None)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class JsonErrors(web_protocol.RequestHandler):
    """aiohttp's protocol with its own error responses (malformed HTTP, a Content-Encoding it cannot decode) in
    OpenAI's error JSON instead of plain text; errors of the application are the middleware's."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web_protocol.StreamResponse:
        plain = super().handle_error(request, status, exc, message)   # logs, and refuses once a response began
        if isinstance(exc, ContentEncodingError):
            error = ApiError(415, f"the request body's Content-Encoding cannot be decoded here ({one_line(exc)}): "
                                  f"send it as one of {', '.join(DECODABLE)}")
        elif plain.status < 500:
            error = ApiError(plain.status, f"the request is not valid HTTP/1.1 ({one_line(exc or message)})")
        else:
            error = ApiError(plain.status, "internal server error (see the server log)")
        response = error.response()
        response.force_close()
        return response
