"""The setup handshake over TCP: the engine's listener (``serve_handshake``) and the agent's ``connect``.

One exchange per agent connection: the engine opens it with a ``Challenge``, the agent sends a ``Hello`` with its
proof of the ring's secret, the engine answers with an ``Offer`` carrying its own proof (or a ``Reject`` saying why
not) and closes the connection; the agent takes the offer only if the engine's proof holds (``blink.nic.remote.proof``).
An agent that proves nothing gets nothing of the ring: the offer is made only after its proof is checked. The
listener is setup only: its thread blocks in ``accept`` between agents and takes no part in any request, so after
setup the engine's CPU does nothing for the agent.

Framing: 4 bytes ``FRAME_MAGIC``, a big-endian u32 payload length (at most ``MAX_FRAME_BYTES``), then the payload
(``wire.encode``). The magic turns a peer that is not a blink handshake (an HTTP client on the wrong port, say) into
a clear error instead of a huge length; the bound keeps a broken peer from making the other side allocate.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
from dataclasses import replace

from blink.errors import HandshakeError, RingRefused
from blink.nic.remote.proof import AGENT, BLANK, ENGINE, nonce, prove, proves
from blink.nic.remote.wire import Challenge, Hello, Offer, Reject, decode, encode
from blink.ring.secret import ENV

FRAME_MAGIC = b"BLHS"
MAX_FRAME_BYTES = 64 * 1024
SETUP_TIMEOUT_S = 10.0      # one exchange; a peer that stalls longer is dropped
MAX_WARNED_PEERS = 1024    # addresses remembered as warned of a failed proof; beyond, the memory starts over
_HEADER = struct.Struct(">4sI")
HOW_TO_PROVE = (f"set ${ENV} on the agent's side to the engine's secret (the ${ENV} the engine was started with, or "
                "the content of the key file /dev/shm/RING.key beside its ring), or on the engine's host give the "
                "agent the ring's name (blink agent --ring-key RING)")
log = logging.getLogger("blink")


class _Silence(HandshakeError):
    """The peer sent nothing within the setup timeout."""


def parse_address(text: str, *, option: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6HOST]:PORT`` as ``(host, port)``; ``ValueError`` naming ``option`` otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{option} must be HOST:PORT with a port in [0, 65535] (got {text!r})")
    return host, int(port)


def send_message(sock: socket.socket, message) -> None:
    payload = encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise HandshakeError(f"a {type(message).__name__} of {len(payload)} bytes exceeds the handshake's "
                             f"{MAX_FRAME_BYTES}-byte frame")
    sock.sendall(_HEADER.pack(FRAME_MAGIC, len(payload)) + payload)


def receive_message(sock: socket.socket):
    """The next message from ``sock``; ``HandshakeError`` if the peer closes early or sends no blink frame."""
    magic, length = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    if magic != FRAME_MAGIC:
        raise HandshakeError(f"the peer is not a blink handshake endpoint (its first bytes are {magic!r}, "
                             f"expected {FRAME_MAGIC!r}): check the HOST:PORT")
    if length > MAX_FRAME_BYTES:
        raise HandshakeError(f"the peer announced a {length}-byte setup message; at most {MAX_FRAME_BYTES} "
                             "are accepted")
    return decode(_receive_exactly(sock, length))


def _receive_exactly(sock: socket.socket, nbytes: int) -> bytes:
    chunks, left = [], nbytes
    while left:
        try:
            chunk = sock.recv(left)
        except TimeoutError:
            raise _Silence(f"the peer sent nothing for {sock.gettimeout()} s during setup") from None
        if not chunk:
            raise HandshakeError(f"the peer closed the connection {nbytes - left} bytes into a {nbytes}-byte "
                                 "setup read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _drain(connection: socket.socket) -> None:
    """Half-close, then read what the peer still sends until it closes (bounded): closing a socket with unread
    input resets the connection, and the reset can destroy the answer before the peer has read it."""
    connection.shutdown(socket.SHUT_WR)
    connection.settimeout(1.0)
    left = MAX_FRAME_BYTES
    try:
        while left > 0:
            chunk = connection.recv(left)
            if not chunk:
                return
            left -= len(chunk)
    except TimeoutError:
        pass


class HandshakeServer:
    """Listens on ``(host, port)`` (port 0: any free one, see ``address``) and answers each agent's ``Hello`` that
    proves it knows ``ring_secret`` with ``answer(hello, proof)``: an ``Offer`` carrying ``proof`` (the engine's),
    or a ``HandshakeError`` whose message goes back as the ``Reject`` reason.

    A ``Hello`` without a right proof gets a ``Reject`` saying where the secret comes from, and ``answer`` is not
    called for it; the refusal is logged once per peer address (an agent retrying does not flood the log).
    Agents are answered one at a time on one thread, each exchange bounded by ``SETUP_TIMEOUT_S``. ``close()``
    stops listening; what ``answer`` set up for agents already answered (their QPs) belongs to its owner.
    """

    def __init__(self, host: str, port: int, answer, ring_secret: str):
        if not isinstance(ring_secret, str) or not ring_secret:
            raise ValueError("ring_secret must be a non-empty str: the secret agents prove they know")
        self._answer, self._secret = answer, ring_secret
        self._warned: set[str] = set()
        try:
            self._socket = socket.create_server((host, port), backlog=16)
        except OSError as e:
            raise HandshakeError(f"cannot listen for agents on {host}:{port} ({e.strerror}): pick another "
                                 "--listen address") from None
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self.offers = 0             # Offers made (before they are sent, so a client that got one sees it counted)
        self.refused = 0            # Hellos refused for their proof
        self._thread = threading.Thread(target=self._serve, name="blink-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, peer = self._socket.accept()
            except OSError:
                return              # close() shut the socket down
            with connection:
                self._answer_one(connection, peer)

    def _answer_one(self, connection: socket.socket, peer) -> None:
        connection.settimeout(SETUP_TIMEOUT_S)
        challenge = nonce()
        try:
            send_message(connection, Challenge(challenge))
        except OSError as e:
            log.warning("could not challenge %s:%s: %s", *peer[:2], e)
            return
        try:
            hello = receive_message(connection)
            if not isinstance(hello, Hello):
                raise HandshakeError(f"an agent's first message must be a hello (got a {type(hello).__name__})")
            if proves(hello.proof, self._secret, AGENT, challenge, hello.nonce, content(hello)):
                offer = self._answer(hello, BLANK)
                reply = replace(offer, proof=prove(self._secret, ENGINE, challenge, hello.nonce, content(offer)))
            else:
                reply = self._refuse(hello, peer[0])
        except HandshakeError as e:
            log.warning("handshake with %s:%s rejected: %s", *peer[:2], e)
            reply = Reject(str(e))
        except Exception as e:          # the engine's setup failed; the agent is told why, the listener goes on
            log.exception("handshake with %s:%s failed", *peer[:2])
            reply = Reject(f"the engine could not set up this agent: {type(e).__name__}: {e}")
        if isinstance(reply, Offer):
            self.offers += 1
            log.info("offered the ring to agent %s:%s over %s", *peer[:2], reply.transport)
        try:
            send_message(connection, reply)
            _drain(connection)
        except OSError as e:
            log.warning("could not answer %s:%s: %s", *peer[:2], e)

    def _refuse(self, hello: Hello, host: str) -> Reject:
        shown = "no proof" if hello.proof is None else "a wrong proof"
        reason = f"this agent showed {shown} of the ring's secret: {HOW_TO_PROVE}"
        self.refused += 1
        if host not in self._warned:
            if len(self._warned) >= MAX_WARNED_PEERS:
                self._warned.clear()
            self._warned.add(host)
            log.warning("refused agents from %s (logged once per address): %s", host, reason)
        return Reject(reason)

    def close(self) -> None:
        """Stop listening and wait for the listener thread (an exchange in progress finishes first)."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)     # wakes the blocking accept()
        except OSError:
            pass
        self._socket.close()
        self._thread.join(SETUP_TIMEOUT_S + 1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_handshake(address: str, answer, ring_secret: str) -> HandshakeServer:
    """A ``HandshakeServer`` on ``address`` (``HOST:PORT``, the engine's ``--listen``)."""
    host, port = parse_address(address, option="--listen")
    return HandshakeServer(host, port, answer, ring_secret)


def connect(address: str, hello, ring_secret: str | None, *, timeout_s: float = SETUP_TIMEOUT_S) -> Offer:
    """The ``Offer`` of the engine listening at ``address`` (``HOST:PORT``), once each side proved the other it
    knows ``ring_secret``: sends ``hello(nonce, proof)`` (a ``Hello`` for this agent's nonce and proof, e.g.
    ``functools.partial(Hello, "ipc", control.VERSION, host=...)``; ``ring_secret`` None: no proof, which the
    engine rejects saying where the secret comes from).

    ``HandshakeError`` if nothing listens there, the engine rejects the agent (with the engine's reason), or the
    answer is malformed or for another transport; ``RingRefused`` if the offer's proof is wrong (whoever answers
    there does not know the secret).
    """
    host, port = parse_address(address, option="--remote")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise HandshakeError(f"no blink engine answers at {host}:{port} ({e.strerror or e}): start it with "
                             f"blink engine --listen {host}:{port}, or check the address") from None
    with sock:
        try:
            challenge = _challenge(sock, f"{host}:{port}", timeout_s)
            mine = nonce()
            request = hello(mine, None)
            if ring_secret is not None:
                request = hello(mine, prove(ring_secret, AGENT, challenge, mine, content(request)))
            send_message(sock, request)
            reply = receive_message(sock)
        except OSError as e:
            raise HandshakeError(f"the connection to the engine at {host}:{port} broke during setup "
                                 f"({e.strerror or e})") from None
    if isinstance(reply, Reject):
        raise HandshakeError(f"the engine at {host}:{port} rejected this agent: {reply.reason}")
    if not isinstance(reply, Offer):
        raise HandshakeError(f"the engine at {host}:{port} answered with a {type(reply).__name__}, not an Offer")
    if ring_secret is None or not proves(reply.proof, ring_secret, ENGINE, challenge, mine, content(reply)):
        raise RingRefused(f"the listener at {host}:{port} did not prove that it knows the ring's secret: it is not "
                          f"the engine whose secret this agent was given (${ENV}, or the ring's key file), or the "
                          "two secrets differ; not attached")
    if reply.transport != request.transport:
        raise HandshakeError(f"asked the engine at {host}:{port} for {request.transport} but it offered "
                             f"{reply.transport}")
    return reply


def content(message) -> bytes:
    """What a proof covers of ``message`` (a ``Hello`` or an ``Offer``): its encoding with the proof ``BLANK``, so
    that the proof binds every other field of it."""
    return encode(replace(message, proof=BLANK))


def _challenge(sock: socket.socket, where: str, timeout_s: float) -> str:
    """The nonce of the engine's opening ``Challenge``."""
    try:
        first = receive_message(sock)
    except _Silence:
        raise HandshakeError(f"the engine at {where} sent no challenge within {timeout_s} s: it is busy with another "
                             "agent (try again), or runs an older blink, whose engine waits for the agent to speak "
                             "first (run the agent and the engine from the same blink version)") from None
    if isinstance(first, Reject):
        raise HandshakeError(f"the engine at {where} rejected this agent: {first.reason}")
    if not isinstance(first, Challenge):
        raise HandshakeError(f"the engine at {where} opened with a {type(first).__name__}, not a Challenge")
    return first.nonce
