"""The setup messages: round trips, and a clear rejection of every malformed or mismatched field."""
import json

import pytest

from blink.errors import HandshakeError
from blink.nic.remote.wire import (HANDSHAKE_VERSION, Challenge, CudaRegion, Endpoint, Hello, Offer, RdmaRegion, Reject,
                                   RingIdentity, ShmRegion, decode, encode)
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=16, max_output_tokens=32, max_stop_ids=2)
SIZE = RingLayout(GEOMETRY).size
SPLIT = RingLayout(GEOMETRY).offset("outputs")
ENDPOINT = Endpoint(qp_num=0x123, psn=0xABCDE, gid="fe80:0000:0000:0000:0000:0000:0000:0001", lid=0, mtu=4096,
                    max_rd_atomic=16)
BOOT = "262ac6de-464f-40df-9cb7-651759ef462b"
NONCE, PROOF = "0f" * 32, "a5" * 32        # the wire's forms of a nonce and a proof (blink.nic.remote.proof makes them)


def rdma_offer():
    regions = (RdmaRegion(0, SPLIT, addr=0x7F0000000000, rkey=0x1234), RdmaRegion(SPLIT, SIZE - SPLIT, 1 << 40, 7))
    return Offer("rdma", RingIdentity.of(GEOMETRY), regions, PROOF, ENDPOINT)


def ipc_offer():
    # The output side at its own offset of the engine's shared-memory ring, as a GPU-memory request side leaves it.
    regions = (CudaRegion(0, SPLIT, bytes(range(64)), "0000:1b:00.0"),
               ShmRegion(SPLIT, SIZE - SPLIT, "blink-1", offset=SPLIT))
    return Offer("ipc", RingIdentity.of(GEOMETRY), regions, PROOF)


MESSAGES = [Hello("rdma", control.VERSION, NONCE, PROOF, endpoint=ENDPOINT),
            Hello("ipc", control.VERSION, NONCE, None, host=BOOT), rdma_offer(), ipc_offer(), Reject("no RDMA here"),
            Challenge(NONCE)]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


def test_the_encoding_is_a_versioned_json_object():
    obj = json.loads(encode(rdma_offer()))
    assert obj["blink_handshake"] == HANDSHAKE_VERSION and obj["type"] == "offer"
    assert obj["ring"]["magic"] == control.MAGIC and obj["ring"]["geometry"]["n_slots"] == 8
    assert [r["kind"] for r in obj["regions"]] == ["rdma", "rdma"]
    assert json.loads(encode(ipc_offer()))["regions"][0]["handle"] == bytes(range(64)).hex()


def mutated(message, edit):
    obj = json.loads(encode(message))
    edit(obj)
    return json.dumps(obj).encode()


def setter(path, value):
    def edit(obj):
        *parents, last = path
        for key in parents:
            obj = obj[key]
        obj[last] = value
    return edit


def deleter(path):
    def edit(obj):
        *parents, last = path
        for key in parents:
            obj = obj[key]
        del obj[last]
    return edit


MALFORMED = [
    # framing of the object itself
    (rdma_offer(), setter(["blink_handshake"], HANDSHAKE_VERSION - 1), f"handshake version {HANDSHAKE_VERSION - 1}"),
    (rdma_offer(), deleter(["blink_handshake"]), "handshake version None"),
    (rdma_offer(), setter(["type"], "welcome"), "unknown setup message type 'welcome'"),
    (rdma_offer(), setter(["surprise"], 1), r"unknown \['surprise'\]"),
    (rdma_offer(), deleter(["endpoint"]), r"missing \['endpoint'\]"),
    # endpoint fields
    (rdma_offer(), setter(["endpoint", "qp_num"], 1 << 24), "Endpoint.qp_num must be an int in"),
    (rdma_offer(), setter(["endpoint", "qp_num"], 1), "Endpoint.qp_num"),
    (rdma_offer(), setter(["endpoint", "psn"], -1), "Endpoint.psn"),
    (rdma_offer(), setter(["endpoint", "psn"], True), "Endpoint.psn"),
    (rdma_offer(), setter(["endpoint", "lid"], 3.0), "Endpoint.lid"),
    (rdma_offer(), setter(["endpoint", "mtu"], 1500), r"Endpoint.mtu must be one of \(256"),
    (rdma_offer(), setter(["endpoint", "max_rd_atomic"], 0), "Endpoint.max_rd_atomic"),
    (rdma_offer(), setter(["endpoint", "gid"], "fe80::1"), "Endpoint.gid must be 8 groups"),
    (rdma_offer(), setter(["endpoint", "gid"], "FE80:0000:0000:0000:0000:0000:0000:0001"), "Endpoint.gid"),
    (rdma_offer(), setter(["endpoint", "gid"], ":".join(["0000"] * 8)), "all zeros"),
    (rdma_offer(), setter(["endpoint"], None), "Endpoint for rdma"),
    (rdma_offer(), setter(["endpoint"], [1, 2]), "endpoint must be a JSON object"),
    # the ring's identity
    (rdma_offer(), setter(["ring", "size"], SIZE + 4096), "but its geometry lays out"),
    (rdma_offer(), setter(["ring", "geometry", "n_slots"], 0), r"RingGeometry.n_slots must be an int in \[1"),
    (rdma_offer(), setter(["ring", "geometry", "logprobs"], 1), "RingGeometry.logprobs must be a bool"),
    (rdma_offer(), deleter(["ring", "geometry", "max_stop_ids"]), "geometry must have exactly the keys"),
    (rdma_offer(), setter(["ring", "geometry"], "big"), "must be an object with a geometry object"),
    (rdma_offer(), setter(["ring", "magic"], -1), "RingIdentity.magic"),
    # regions
    (rdma_offer(), setter(["regions"], []), "1 to 16 regions"),
    (rdma_offer(), setter(["regions"], {"kind": "rdma"}), "regions must be a JSON list"),
    (rdma_offer(), setter(["regions", 0, "kind"], "nfs"), r"kind is one of \['cuda', 'rdma', 'shm'\]"),
    (rdma_offer(), setter(["regions", 0, "rkey"], 1 << 32), "RdmaRegion.rkey"),
    (rdma_offer(), setter(["regions", 0, "addr"], (1 << 64) - 4096), "past the 64-bit address space"),
    (rdma_offer(), setter(["regions", 1, "start"], SPLIT + 4096), "must tile the ring in order"),
    (rdma_offer(), setter(["regions", 1, "start"], SPLIT - 4096), "must tile the ring in order"),
    (rdma_offer(), setter(["regions", 1, "size"], SIZE - SPLIT - 4096), f"but the ring is {SIZE} bytes"),
    (rdma_offer(), setter(["regions", 0, "size"], SPLIT + 1), r"must tile the ring in order from 0 on 4096"),
    (rdma_offer(), setter(["regions", 1], {"kind": "shm", "start": SPLIT, "size": SIZE - SPLIT, "name": "x",
                                           "offset": 0}), "rdma offers RdmaRegion"),
    (ipc_offer(), setter(["regions", 0, "handle"], "zz" * 64), "handle must be hex digits"),
    (ipc_offer(), setter(["regions", 0, "handle"], "00" * 63), "CudaRegion.handle must be 64 bytes"),
    (ipc_offer(), setter(["regions", 0, "pci_bus_id"], "gpu0"), "CudaRegion.pci_bus_id"),
    (ipc_offer(), setter(["regions", 1, "name"], "../etc/passwd"), "ShmRegion.name"),
    (ipc_offer(), setter(["regions", 1, "offset"], -4096), r"ShmRegion.offset must be an int in \[0, "),
    (ipc_offer(), setter(["regions", 1, "offset"], True), "ShmRegion.offset"),
    (ipc_offer(), deleter(["regions", 1, "offset"]), r"exactly the keys \['start', 'size', 'name', 'offset'\]"),
    (ipc_offer(), setter(["endpoint"], ENDPOINT.__dict__), "none for ipc"),
    # hello and reject
    (MESSAGES[0], setter(["transport"], "tcp"), r"Hello.transport must be one of \('rdma', 'ipc'\)"),
    (MESSAGES[0], setter(["host"], BOOT), "no host"),
    (MESSAGES[1], setter(["host"], "my-laptop"), "Hello.host must be a boot id"),
    (MESSAGES[1], setter(["ring_version"], "1"), "Hello.ring_version"),
    (MESSAGES[4], setter(["reason"], ""), "Reject.reason must be a non-empty string"),
    # the nonces and proofs of the ring's secret
    (MESSAGES[5], setter(["nonce"], "0F" * 32), "Challenge.nonce must be 64 lower-case hex digits"),
    (MESSAGES[5], setter(["nonce"], "0f" * 16), "Challenge.nonce must be 64 lower-case hex digits"),
    (MESSAGES[0], deleter(["nonce"]), r"missing \['nonce'\]"),
    (MESSAGES[0], setter(["proof"], 7), "Hello.proof must be 64 lower-case hex digits"),
    (MESSAGES[1], deleter(["proof"]), r"missing \['proof'\]"),
    (rdma_offer(), setter(["proof"], None), "Offer.proof must be 64 lower-case hex digits"),
    (rdma_offer(), setter(["proof"], "a5" * 33), "Offer.proof must be 64 lower-case hex digits"),
]


@pytest.mark.parametrize("message,edit,match", MALFORMED, ids=[m for _, _, m in MALFORMED])
def test_malformed_messages_are_rejected_naming_the_field(message, edit, match):
    with pytest.raises(HandshakeError, match=match):
        decode(mutated(message, edit))


@pytest.mark.parametrize("payload,match", [
    (b"\xff\xfe", "not UTF-8 JSON"),
    (b"{", "not UTF-8 JSON"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b'{"blink_handshake": 1, "blink_handshake": 1, "type": "reject", "reason": "x"}', "repeats a key"),
])
def test_garbage_is_rejected(payload, match):
    with pytest.raises(HandshakeError, match=match):
        decode(payload)


def test_handshake_errors_are_value_errors_and_blink_errors():
    from blink.errors import BlinkError

    assert issubclass(HandshakeError, ValueError) and issubclass(HandshakeError, BlinkError)


def test_the_agent_refuses_a_ring_of_another_magic_or_protocol_version():
    RingIdentity.of(GEOMETRY).check_served_by_this_blink()
    with pytest.raises(HandshakeError, match="not a blink ring"):
        RingIdentity(0x1234, control.VERSION, SIZE, GEOMETRY).check_served_by_this_blink()
    with pytest.raises(HandshakeError, match="protocol version 99"):
        RingIdentity(control.MAGIC, 99, SIZE, GEOMETRY).check_served_by_this_blink()

