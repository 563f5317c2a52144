"""The handshake over loopback TCP: framing, the setup-only listener, the client, and their errors."""
import socket
import struct
import threading

import pytest

from blink.errors import HandshakeError
from blink.nic import handshake
from blink.nic.handshake import FRAME_MAGIC, MAX_FRAME_BYTES, connect, parse_address, serve_handshake
from blink.nic.wire import Hello, Reject, encode
from blink.ring import control

from .test_wire import BOOT, ENDPOINT, ipc_offer, rdma_offer

RDMA_HELLO = Hello("rdma", control.VERSION, endpoint=ENDPOINT)


@pytest.fixture
def server():
    """A listener on a free loopback port whose answer a test sets; records the hellos it got."""
    state = {"hellos": [], "answer": lambda hello: rdma_offer()}

    def answer(hello):
        state["hellos"].append(hello)
        return state["answer"](hello)

    with serve_handshake("127.0.0.1:0", answer) as listener:
        state["address"] = "%s:%d" % listener.address
        state["listener"] = listener
        yield state


def test_the_listener_answers_several_agents_one_exchange_each(server):
    assert connect(server["address"], RDMA_HELLO) == rdma_offer()
    server["answer"] = lambda hello: ipc_offer()
    assert connect(server["address"], Hello("ipc", control.VERSION, host=BOOT)) == ipc_offer()
    assert server["hellos"] == [RDMA_HELLO, Hello("ipc", control.VERSION, host=BOOT)]
    assert server["listener"].offers == 2


def test_a_rejection_reaches_the_agent_with_the_engines_reason(server):
    def refuse(hello):
        raise HandshakeError("this engine was started without RDMA")

    server["answer"] = refuse
    with pytest.raises(HandshakeError, match="rejected this agent: this engine was started without RDMA"):
        connect(server["address"], RDMA_HELLO)
    assert server["listener"].offers == 0


def test_an_engine_side_failure_is_a_rejection_and_the_listener_goes_on(server):
    def crash(hello):
        raise RuntimeError("ibv_create_qp: ENOMEM")

    server["answer"] = crash
    with pytest.raises(HandshakeError, match="could not set up this agent: RuntimeError: ibv_create_qp: ENOMEM"):
        connect(server["address"], RDMA_HELLO)
    server["answer"] = lambda hello: rdma_offer()
    assert connect(server["address"], RDMA_HELLO) == rdma_offer()


def test_an_offer_for_another_transport_is_refused(server):
    server["answer"] = lambda hello: ipc_offer()
    with pytest.raises(HandshakeError, match="asked the engine .* for rdma but it offered ipc"):
        connect(server["address"], RDMA_HELLO)


def raw_exchange(address, payload: bytes) -> bytes:
    """Send ``payload``, half-close, return everything the listener answers."""
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(payload)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass                # the listener already answered and closed
        return b"".join(iter(lambda: sock.recv(65536), b""))


def reply_reason(raw: bytes) -> str:
    from blink.nic.wire import decode

    magic, length = struct.unpack(">4sI", raw[:8])
    assert magic == FRAME_MAGIC and len(raw) == 8 + length
    reply = decode(raw[8:])
    assert isinstance(reply, Reject)
    return reply.reason


@pytest.mark.parametrize("payload,reason", [
    (b"GET / HTTP/1.1\r\n\r\n", "not a blink handshake endpoint (its first bytes are b'GET '"),
    (FRAME_MAGIC + struct.pack(">I", MAX_FRAME_BYTES + 1), f"at most {MAX_FRAME_BYTES} are accepted"),
    (FRAME_MAGIC + struct.pack(">I", 100) + b"{}", "closed the connection 2 bytes into a 100-byte setup read"),
    (FRAME_MAGIC + struct.pack(">I", 2) + b"{}", "handshake version None"),
    (FRAME_MAGIC + struct.pack(">I", len(encode(rdma_offer()))) + encode(rdma_offer()),
     "must be a hello (got a Offer)"),
])
def test_malformed_frames_get_a_reject_saying_why(server, payload, reason):
    assert reason in reply_reason(raw_exchange(server["address"], payload))
    assert connect(server["address"], RDMA_HELLO) == rdma_offer(), "the listener serves the next agent"


def test_a_silent_peer_is_dropped_after_the_setup_timeout(server, monkeypatch):
    monkeypatch.setattr(handshake, "SETUP_TIMEOUT_S", 0.2)
    host, port = parse_address(server["address"])
    with socket.create_connection((host, port), timeout=5) as sock:
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    assert "sent nothing for 0.2 s" in reply_reason(raw)


def test_nothing_listening_names_the_address_and_what_to_start():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(HandshakeError, match=f"no blink engine answers at 127.0.0.1:{port}.*--listen"):
        connect(f"127.0.0.1:{port}", RDMA_HELLO)


def test_a_server_that_is_not_blink_is_named():
    with socket.create_server(("127.0.0.1", 0)) as other:
        def http():
            connection, _ = other.accept()
            with connection:
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=http)
        thread.start()
        with pytest.raises(HandshakeError, match="not a blink handshake endpoint.*check the HOST:PORT"):
            connect("127.0.0.1:%d" % other.getsockname()[1], RDMA_HELLO)
        thread.join()


def test_a_busy_address_cannot_be_listened_on(server):
    with pytest.raises(HandshakeError, match="cannot listen for agents on 127.0.0.1"):
        serve_handshake(server["address"], lambda hello: None)


def test_close_stops_the_listener_thread():
    listener = serve_handshake("127.0.0.1:0", lambda hello: rdma_offer())
    address = "%s:%d" % listener.address
    listener.close()
    assert not listener._thread.is_alive()
    with pytest.raises(HandshakeError, match="no blink engine answers"):
        connect(address, RDMA_HELLO)


@pytest.mark.parametrize("text,expected", [("10.0.0.2:7000", ("10.0.0.2", 7000)), ("[::1]:0", ("::1", 0)),
                                           ("dpu-host:65535", ("dpu-host", 65535))])
def test_addresses_parse(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["7000", ":7000", "host:", "host:http", "host:65536", "host:-1"])
def test_bad_addresses_name_the_option(text):
    with pytest.raises(ValueError, match="--remote must be HOST:PORT"):
        parse_address(text, option="--remote")
