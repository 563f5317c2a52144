"""The handshake over loopback TCP: framing, the setup-only listener, the client, their errors, and the proofs of
the ring's secret both ways (no offer to an agent that does not prove it, none taken from an engine that does not,
no proof that works twice)."""
import dataclasses
import functools
import hashlib
import hmac
import logging
import socket
import struct
import threading

import pytest

from blink.errors import HandshakeError, RingRefused
from blink.nic.remote import handshake, proof
from blink.nic.remote.handshake import FRAME_MAGIC, MAX_FRAME_BYTES, connect, content, parse_address, serve_handshake
from blink.nic.remote.wire import Challenge, Hello, Offer, Reject, decode, encode
from blink.ring import control

from .test_wire import BOOT, ENDPOINT, PROOF, ipc_offer, rdma_offer

SECRET = "the ring's secret, as the engine published it"
RDMA_HELLO = functools.partial(Hello, "rdma", control.VERSION, endpoint=ENDPOINT)
IPC_HELLO = functools.partial(Hello, "ipc", control.VERSION, host=BOOT)


def proven(offer):
    """``offer`` as the engine's answer for an exchange whose proof is ``proof``: the test offers carry a dummy."""
    return lambda hello, proof: dataclasses.replace(offer, proof=proof)


def unproven(offer):
    """``offer`` with the dummy proof of the test offers, to compare an agent's offer with them."""
    return dataclasses.replace(offer, proof=PROOF)


@pytest.fixture
def server():
    """A listener on a free loopback port whose answer a test sets; records the hellos it answered."""
    state = {"hellos": [], "answer": proven(rdma_offer())}

    def answer(hello, proof):
        state["hellos"].append(hello)
        return state["answer"](hello, proof)

    with serve_handshake("127.0.0.1:0", answer, SECRET) as listener:
        state["address"] = "%s:%d" % listener.address
        state["listener"] = listener
        yield state


def test_the_listener_answers_several_agents_one_exchange_each(server):
    assert unproven(connect(server["address"], RDMA_HELLO, SECRET)) == rdma_offer()
    server["answer"] = proven(ipc_offer())
    assert unproven(connect(server["address"], IPC_HELLO, SECRET)) == ipc_offer()
    assert [(h.transport, h.endpoint, h.host) for h in server["hellos"]] == [("rdma", ENDPOINT, None),
                                                                             ("ipc", None, BOOT)]
    assert server["hellos"][0].nonce != server["hellos"][1].nonce, "a fresh nonce per exchange"
    assert server["listener"].offers == 2 and server["listener"].refused == 0


def test_a_rejection_reaches_the_agent_with_the_engines_reason(server):
    def refuse(hello, proof):
        raise HandshakeError("this engine was started without RDMA")

    server["answer"] = refuse
    with pytest.raises(HandshakeError, match="rejected this agent: this engine was started without RDMA"):
        connect(server["address"], RDMA_HELLO, SECRET)
    assert server["listener"].offers == 0


def test_an_engine_side_failure_is_a_rejection_and_the_listener_goes_on(server):
    def crash(hello, proof):
        raise RuntimeError("ibv_create_qp: ENOMEM")

    server["answer"] = crash
    with pytest.raises(HandshakeError, match="could not set up this agent: RuntimeError: ibv_create_qp: ENOMEM"):
        connect(server["address"], RDMA_HELLO, SECRET)
    server["answer"] = proven(rdma_offer())
    assert unproven(connect(server["address"], RDMA_HELLO, SECRET)) == rdma_offer()


def test_an_offer_for_another_transport_is_refused(server):
    server["answer"] = proven(ipc_offer())
    with pytest.raises(HandshakeError, match="asked the engine .* for rdma but it offered ipc"):
        connect(server["address"], RDMA_HELLO, SECRET)


def frame(message) -> bytes:
    payload = encode(message)
    return struct.pack(">4sI", FRAME_MAGIC, len(payload)) + payload


def messages(raw: bytes) -> list:
    """Every message in the frames of ``raw``, which must hold whole frames only."""
    found = []
    while raw:
        magic, length = struct.unpack(">4sI", raw[:8])
        assert magic == FRAME_MAGIC and len(raw) >= 8 + length
        found.append(decode(raw[8:8 + length]))
        raw = raw[8 + length:]
    return found


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
    """The reason of the listener's reject, after its challenge: all it may have sent."""
    challenge, reply = messages(raw)
    assert isinstance(challenge, Challenge) and isinstance(reply, Reject)
    return reply.reason


@pytest.mark.parametrize("payload,reason", [
    (b"GET / HTTP/1.1\r\n\r\n", "not a blink handshake endpoint (its first bytes are b'GET '"),
    (FRAME_MAGIC + struct.pack(">I", MAX_FRAME_BYTES + 1), f"at most {MAX_FRAME_BYTES} are accepted"),
    (FRAME_MAGIC + struct.pack(">I", 100) + b"{}", "closed the connection 2 bytes into a 100-byte setup read"),
    (FRAME_MAGIC + struct.pack(">I", 2) + b"{}", "handshake version None"),
    (frame(rdma_offer()), "must be a hello (got a Offer)"),
])
def test_malformed_frames_get_a_reject_saying_why(server, payload, reason):
    assert reason in reply_reason(raw_exchange(server["address"], payload))
    assert unproven(connect(server["address"], RDMA_HELLO, SECRET)) == rdma_offer(), "the next agent is served"


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
        connect(f"127.0.0.1:{port}", RDMA_HELLO, SECRET)


def test_a_server_that_is_not_blink_is_named():
    with socket.create_server(("127.0.0.1", 0)) as other:
        def http():
            connection, _ = other.accept()
            with connection:
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=http)
        thread.start()
        with pytest.raises(HandshakeError, match="not a blink handshake endpoint.*check the HOST:PORT"):
            connect("127.0.0.1:%d" % other.getsockname()[1], RDMA_HELLO, SECRET)
        thread.join()


def test_a_busy_address_cannot_be_listened_on(server):
    with pytest.raises(HandshakeError, match="cannot listen for agents on 127.0.0.1"):
        serve_handshake(server["address"], lambda hello, proof: None, SECRET)


def test_close_stops_the_listener_thread():
    listener = serve_handshake("127.0.0.1:0", proven(rdma_offer()), SECRET)
    address = "%s:%d" % listener.address
    listener.close()
    assert not listener._thread.is_alive()
    with pytest.raises(HandshakeError, match="no blink engine answers"):
        connect(address, RDMA_HELLO, SECRET)


@pytest.mark.parametrize("text,expected", [("10.0.0.2:7000", ("10.0.0.2", 7000)), ("[::1]:0", ("::1", 0)),
                                           ("dpu-host:65535", ("dpu-host", 65535))])
def test_addresses_parse(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["7000", ":7000", "host:", "host:http", "host:65536", "host:-1"])
def test_bad_addresses_name_the_option(text):
    with pytest.raises(ValueError, match="--remote must be HOST:PORT"):
        parse_address(text, option="--remote")


# -- the proofs of the ring's secret ----------------------------------------------------------------------------

def test_a_proof_is_the_hmac_of_its_label_both_nonces_and_the_message_keyed_by_the_secret():
    challenge, nonce, content = proof.nonce(), proof.nonce(), b'{"type":"hello"}'
    reference = hmac.new(SECRET.encode(), b"blink handshake agent proof\0" + bytes.fromhex(challenge + nonce) + content,
                         hashlib.sha256).hexdigest()
    made = proof.prove(SECRET, proof.AGENT, challenge, nonce, content)
    assert made == reference and proof.proves(made, SECRET, proof.AGENT, challenge, nonce, content)
    others = [proof.prove(SECRET, proof.ENGINE, challenge, nonce, content),
              proof.prove("guess", proof.AGENT, challenge, nonce, content),
              proof.prove(SECRET, proof.AGENT, proof.nonce(), nonce, content),
              proof.prove(SECRET, proof.AGENT, nonce, challenge, content),
              proof.prove(SECRET, proof.AGENT, challenge, nonce, content + b" ")]
    assert len({made, *others}) == 6
    assert not proof.proves(None, SECRET, proof.AGENT, challenge, nonce, content)


def exchange(address, hello: Hello) -> list:
    """As an agent would, but sending ``hello`` whatever the challenge: every message the listener sent."""
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=5) as sock:
        challenge = handshake.receive_message(sock)
        sock.sendall(frame(hello))
        sock.shutdown(socket.SHUT_WR)
        return [challenge, *messages(b"".join(iter(lambda: sock.recv(65536), b"")))]


@pytest.mark.parametrize("secret", ["a guess", None], ids=["wrong secret", "no secret"])
def test_an_agent_without_the_secret_gets_a_reject_saying_where_it_comes_from_and_nothing_of_the_ring(
        server, secret, caplog):
    shown = "a wrong proof" if secret else "no proof"
    with caplog.at_level(logging.WARNING, logger="blink"):
        for _ in range(3):
            with pytest.raises(HandshakeError, match=f"rejected this agent: this agent showed {shown} of the ring's "
                                                     r"secret: set \$BLINK_RING_SECRET on the agent's side"):
                connect(server["address"], IPC_HELLO, secret)
    forged = None if secret is None else proof.prove(secret, proof.AGENT, "00" * 32, "11" * 32, b"")
    challenge, reject = exchange(server["address"], IPC_HELLO(proof.nonce(), forged))
    assert isinstance(challenge, Challenge) and isinstance(reject, Reject), "a challenge and a reject, nothing else"
    assert "/dev/shm/RING.key" in reject.reason and "--ring-key" in reject.reason
    assert server["hellos"] == [], "the engine's answer (its QP, its regions) was never asked for"
    assert server["listener"].offers == 0 and server["listener"].refused == 4
    refusals = [r.getMessage() for r in caplog.records if "refused agents from 127.0.0.1" in r.getMessage()]
    assert len(refusals) == 1 and shown in refusals[0], "logged once per peer"
    server["answer"] = proven(ipc_offer())
    assert unproven(connect(server["address"], IPC_HELLO, SECRET)) == ipc_offer(), "the secret's holder is served"


def test_a_replayed_hello_is_refused(server):
    """A Hello captured on one connection (its proof for that connection's challenge) sent again on another."""
    captured = []

    def recording(nonce, proof):
        captured.append(IPC_HELLO(nonce, proof))
        return captured[-1]

    server["answer"] = proven(ipc_offer())
    connect(server["address"], recording, SECRET)
    challenge, reject = exchange(server["address"], captured[-1])
    assert isinstance(challenge, Challenge) and isinstance(reject, Reject), "a challenge and a reject, nothing else"
    assert "showed a wrong proof" in reject.reason
    assert len(server["hellos"]) == 1 and server["listener"].offers == 1 and server["listener"].refused == 1


@pytest.fixture
def fake_listener():
    """A listener that challenges and reads the agent's Hello as an engine does but cannot check its proof: it
    answers ``state["offer"](challenge, hello)``, an Offer with whatever proof it can come up with."""
    state = {}
    with socket.create_server(("127.0.0.1", 0)) as sock:
        def serve():
            while True:
                try:
                    connection, _ = sock.accept()
                except OSError:
                    return
                with connection:
                    challenge = proof.nonce()
                    handshake.send_message(connection, Challenge(challenge))
                    hello = handshake.receive_message(connection)
                    handshake.send_message(connection, state["offer"](challenge, hello))
                    handshake._drain(connection)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        state["address"] = "127.0.0.1:%d" % sock.getsockname()[1]
        yield state
        sock.shutdown(socket.SHUT_RDWR)
    thread.join(5)


def test_an_offer_whose_proof_is_wrong_is_refused_naming_the_address(server, fake_listener):
    """A listener that does not know the secret: a proof made with another, the agent's own proof sent back, and a
    genuine engine's proof recorded from another exchange (another agent nonce) all fail."""
    recorded = connect(server["address"], RDMA_HELLO, SECRET)
    offers = {"another secret": lambda c, h: proof.prove("a guess", proof.ENGINE, c, h.nonce, content(recorded)),
              "the agent's own proof": lambda c, h: h.proof,
              "a recorded proof": lambda c, h: recorded.proof}
    for name, forged in offers.items():
        fake_listener["offer"] = lambda c, h: dataclasses.replace(recorded, proof=forged(c, h))
        with pytest.raises(RingRefused, match=f"the listener at {fake_listener['address']} did not prove that it "
                                              "knows the ring's secret"):
            connect(fake_listener["address"], RDMA_HELLO, SECRET)
    fake_listener["offer"] = lambda c, h: dataclasses.replace(recorded, proof=proof.prove(SECRET, proof.ENGINE, c,
                                                                                          h.nonce, content(recorded)))
    assert isinstance(connect(fake_listener["address"], RDMA_HELLO, SECRET), Offer), "a proof made with the secret"


def test_an_offer_changed_on_its_way_is_refused(server, fake_listener):
    """Whoever sits between the two sides relays the engine's genuine proof but changes the offer (here the QP the
    agent would connect to): the proof covers the whole offer, so the agent refuses it."""
    recorded = connect(server["address"], RDMA_HELLO, SECRET)
    moved = dataclasses.replace(recorded, endpoint=dataclasses.replace(recorded.endpoint,
                                                                       qp_num=recorded.endpoint.qp_num + 1))
    fake_listener["offer"] = lambda c, h: dataclasses.replace(moved, proof=proof.prove(SECRET, proof.ENGINE, c,
                                                                                       h.nonce, content(recorded)))
    with pytest.raises(RingRefused, match="did not prove that it knows the ring's secret"):
        connect(fake_listener["address"], RDMA_HELLO, SECRET)


def test_a_hello_changed_on_its_way_gets_a_reject(server):
    """The agent's proof covers its Hello (its QP, its host): one with another QP and the original proof is
    refused, and the engine makes no offer."""
    host, port = parse_address(server["address"])
    with socket.create_connection((host, port), timeout=5) as sock:
        challenge = handshake.receive_message(sock).nonce
        mine = proof.nonce()
        genuine = RDMA_HELLO(mine, None)
        signed = proof.prove(SECRET, proof.AGENT, challenge, mine, content(genuine))
        endpoint = dataclasses.replace(genuine.endpoint, qp_num=genuine.endpoint.qp_num + 1)
        handshake.send_message(sock, dataclasses.replace(genuine, endpoint=endpoint, proof=signed))
        assert isinstance(handshake.receive_message(sock), Reject)
    assert server["hellos"] == [] and server["listener"].offers == 0 and server["listener"].refused == 1


def test_peers_of_another_handshake_version_get_a_clear_error(server, monkeypatch):
    """An agent of the previous version speaks first with its hello; an engine of it waits for that hello."""
    old_hello = encode(IPC_HELLO(proof.nonce(), None)).replace(b'"blink_handshake":3', b'"blink_handshake":2')
    raw = raw_exchange(server["address"], struct.pack(">4sI", FRAME_MAGIC, len(old_hello)) + old_hello)
    assert "the peer speaks handshake version 2, this blink 3: run the agent and the engine from the same" \
        in reply_reason(raw)
    with socket.create_server(("127.0.0.1", 0)) as old_engine:
        with pytest.raises(HandshakeError, match="sent no challenge within 0.2 s.*an older blink, whose engine waits "
                                                 "for the agent to speak first"):
            connect("127.0.0.1:%d" % old_engine.getsockname()[1], IPC_HELLO, SECRET, timeout_s=0.2)


def test_a_listener_needs_a_secret():
    with pytest.raises(ValueError, match="ring_secret must be a non-empty str"):
        serve_handshake("127.0.0.1:0", proven(rdma_offer()), "")
