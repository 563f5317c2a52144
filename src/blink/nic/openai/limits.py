"""What a slow or greedy client may hold of the server once its request head is in: time and bytes of a body, and
places among the bodies received at once (``connections`` holds what a connection may hold before that).

Without these, 300 almost complete 1 MB bodies doubled the agent's memory, and 64 bodies trickling one byte a second
made every other request wait 28 s. A small body (``is_small``: its declared length fits aiohttp's read buffer, which
a connection holds whether it waits or not) takes no place. A larger one waits for one of ``max_pending_bodies``
places (``BodyPlaces``) in arrival order, holding no more of its body than aiohttp's read buffer (it stops reading the
socket beyond that); once it has a place it must arrive at ``min_body_rate`` bytes a second or faster (after a grace
of ``RATE_GRACE_S``), or it loses the place with a 408. The places also bound the large requests queued for the
tokenizer. The wait and the body share one deadline, ``body_timeout_s`` after the request head: no place by then is
a 503, a place but not the whole body (``read_body``) a 408. A burst of many requests is therefore queued, not
refused.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from aiohttp import http_exceptions, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD

from blink.nic.openai.errors import ApiError
from blink.ring.shares import Share

# aiohttp's read buffer per connection (web_protocol's read_bufsize): what a body can hold of the server before its
# handler reads it, place or not.
SMALL_BODY_BYTES = 1 << 16
RATE_GRACE_S = 1.0              # a body's first min_body_rate bytes may take this long after it got its place
# The Content-Encodings of a body this server reads: aiohttp's, br and zstd where their libraries are installed.
DECODABLE = ("gzip", "deflate", "identity") + ("br",) * HAS_BROTLI + ("zstd",) * HAS_ZSTD


@dataclass(frozen=True)
class HttpLimits:
    """``max_head_bytes``: a request line and headers (32 KiB, nginx's default buffers); ``min_body_rate``: bytes a
    second a large body must keep arriving at once it holds one of ``max_pending_bodies`` places."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_head_bytes: int = 32 << 10
    max_body_bytes: int = 1 << 20
    min_body_rate: int = 64 << 10
    max_pending_bodies: int = 64
    max_connections: int = 4096
    keepalive_timeout_s: float = 15.0

    def per_process(self, share: Share) -> HttpLimits:
        """One agent process's limits where ``share.agents`` processes serve (``blink serve --agent-processes``):
        what the whole server may hold at once (bodies being received, connections) is split among them
        (``Share.cap``: rounded up); what one request may take (its time, its bytes) stays as it is."""
        return replace(self, max_pending_bodies=share.cap(self.max_pending_bodies),
                       max_connections=share.cap(self.max_connections))

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"HttpLimits.{name} must be in (0, 3600] seconds (got {getattr(self, name)!r})")
        for name in ("max_head_bytes", "max_body_bytes", "min_body_rate", "max_pending_bodies", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HttpLimits.{name} must be a positive int (got {value!r})")


def is_small(request: web.BaseRequest) -> bool:
    """Whether the body needs no place: its declared length fits aiohttp's read buffer and it is not compressed (a
    small gzip body may inflate to the size cap)."""
    return (request.content_length is not None and request.content_length <= SMALL_BODY_BYTES
            and "Content-Encoding" not in request.headers)


class BodyPlaces:
    """The ``max_pending_bodies`` places of large bodies being received and parsed."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self._places = asyncio.Semaphore(limits.max_pending_bodies)

    @asynccontextmanager
    async def receiving(self, deadline: float):
        """Hold a place, waiting for one in arrival order until ``deadline`` (the event loop's clock; 503 if none
        came by then); yields when the place was granted, the start of the body's minimum rate."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._places.acquire()
        except TimeoutError:
            raise ApiError(503, f"all {self.limits.max_pending_bodies} places for a request body being received were "
                                f"taken for {self.limits.body_timeout_s:.0f} s: retry later", retry_after_s=1) from None
        try:
            yield asyncio.get_running_loop().time()
        finally:
            self._places.release()


async def read_body(request: web.BaseRequest, limits: HttpLimits, deadline: float,
                    rate_from: float | None = None) -> bytes:
    """The request's body, received by ``deadline`` (the event loop's clock: ``body_timeout_s`` after the request
    head), within the size limit and, from ``rate_from`` on (None: no rate), at ``min_body_rate`` (413 / 415 / 408 /
    400 with what to do)."""
    check_encoding(request)
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise ApiError(413, f"the request body is {request.content_length} bytes; at most {limits.max_body_bytes} "
                            "are accepted")
    body = bytearray()
    behind = False              # the deadline in force is the rate's, not the body's
    try:
        async with asyncio.timeout_at(deadline) as timeout:
            while True:
                if rate_from is not None:
                    due = rate_from + RATE_GRACE_S + len(body) / limits.min_body_rate
                    behind = due < deadline
                    timeout.reschedule(min(due, deadline))
                chunk = await request.content.readany()
                if not chunk:
                    return bytes(body)
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise ApiError(413, f"the request body is over {limits.max_body_bytes} bytes (after decoding "
                                        "its Content-Encoding, if any): send less")
    except web.RequestPayloadError as e:
        encoding = request.headers.get("Content-Encoding")
        raise ApiError(400, f"the request body could not be read ({one_line(e)}): send it plain" +
                       (f", or as valid {encoding}" if encoding else "")) from None
    except TimeoutError:
        # aiohttp closes the connection after the answer: the rest of the body was never read.
        if behind:
            raise ApiError(408, f"the request body arrived slower than {limits.min_body_rate} bytes a second "
                                f"(after {len(body)} bytes): send it at once") from None
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:.0f} s") from None


def check_encoding(request: web.BaseRequest) -> None:
    """415 for a Content-Encoding this server does not decode (aiohttp passes unknown ones through undecoded)."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in DECODABLE:
        raise ApiError(415, f"Content-Encoding {encoding[:40]!r} is not supported: send the body as one of "
                            f"{', '.join(DECODABLE)}")


def one_line(error) -> str:
    return " ".join(str(error).split())


class OneLineBadRequests(logging.Filter):
    """aiohttp logs each malformed request with a traceback; a client's bad bytes are worth one line, not ten."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (http_exceptions.BadHttpMessage,
                                                               web.RequestPayloadError)):
            record.msg = f"{record.getMessage()}: {type(record.exc_info[1]).__name__}: {one_line(record.exc_info[1])}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True
