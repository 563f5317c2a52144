"""The setup handshake's messages: what an agent and an engine exchange once, before any request.

Four messages, each a JSON object with ``"blink_handshake": HANDSHAKE_VERSION`` and a ``"type"``:

- ``challenge`` (engine -> agent, first): a fresh nonce the agent's proof must cover (``blink.nic.remote.proof``);
- ``hello`` (agent -> engine): the transport it wants (``rdma`` or ``ipc``), its ring protocol version, its nonce
  and its proof of the ring's secret (null: it has none), and its QP's ``Endpoint`` (rdma) or its host's boot id
  (ipc: the engine's memory can be mapped only on the engine's host);
- ``offer`` (engine -> agent): the ring's identity (magic, version, geometry, size), the regions that hold its bytes
  (rdma: remote address + rkey each; ipc: a shared-memory name or a CUDA IPC handle each), the engine's proof of the
  ring's secret and, for rdma, the engine's QP ``Endpoint``;
- ``reject`` (either way): why the peer cannot be served, in words.

The values they carry (``RingIdentity``, the regions, ``Endpoint``) are in ``blink.nic.remote.regions``.

Why JSON, not a packed struct: the exchange happens once per agent, so size and speed do not matter, while a
self-describing object lets each rejection name the wrong field, a version add fields, and a capture be read.
Parsing is strict all the same: exact key sets (no missing, unknown or duplicate keys), ints that are ints (not
bools or floats) within range, strings in their formats, regions that tile the ring. Failures: ``HandshakeError``.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields

from blink.errors import HandshakeError
from blink.nic.remote.proof import HEX, NONCE_BYTES
from blink.nic.remote.regions import CudaRegion, Endpoint, RdmaRegion, RingIdentity, ShmRegion, check_int, check_str
from blink.ring.geometry import RingGeometry
from blink.ring.layout import REGION_ALIGN

HANDSHAKE_VERSION = 3       # 2: ShmRegion.offset; 3: Challenge, and the proofs of the ring's secret
RDMA, IPC = "rdma", "ipc"
TRANSPORTS = (RDMA, IPC)
MAX_REGIONS = 16
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
REGION_KINDS = {"rdma": RdmaRegion, "shm": ShmRegion, "cuda": CudaRegion}
_TRANSPORT_REGIONS = {RDMA: (RdmaRegion,), IPC: (ShmRegion, CudaRegion)}


def _check_transport(where: str, transport) -> None:
    if transport not in TRANSPORTS:
        raise HandshakeError(f"{where} must be one of {TRANSPORTS} (got {transport!r})")


def _check_hex(where: str, value) -> None:
    check_str(where, value, HEX, f"{2 * NONCE_BYTES} lower-case hex digits")


@dataclass(frozen=True)
class Challenge:
    """The listener's first message on every connection: the nonce this connection's proofs must cover."""

    nonce: str

    def __post_init__(self):
        _check_hex("Challenge.nonce", self.nonce)


@dataclass(frozen=True)
class Hello:
    """The agent's request: a transport, its ring protocol version, its nonce and proof (None: it knows no
    secret), and its QP (rdma) or boot id (ipc)."""

    transport: str
    ring_version: int
    nonce: str
    proof: str | None
    endpoint: Endpoint | None = None
    host: str | None = None

    def __post_init__(self):
        _check_transport("Hello.transport", self.transport)
        check_int("Hello.ring_version", self.ring_version, 0, 0xFFFFFFFF)
        _check_hex("Hello.nonce", self.nonce)
        if self.proof is not None:
            _check_hex("Hello.proof", self.proof)
        if self.transport == RDMA and (not isinstance(self.endpoint, Endpoint) or self.host is not None):
            raise HandshakeError("an rdma Hello carries the agent's QP Endpoint and no host")
        if self.transport == IPC:
            if self.endpoint is not None:
                raise HandshakeError("an ipc Hello carries the agent's host boot id and no Endpoint")
            check_str("Hello.host", self.host, _BOOT_ID, "a boot id (/proc/sys/kernel/random/boot_id)")


@dataclass(frozen=True)
class Offer:
    """The engine's answer: the ring, the regions that tile it (in order, each on a ``REGION_ALIGN`` boundary,
    all of the transport's kinds), the engine's proof and, for rdma, the engine's QP."""

    transport: str
    ring: RingIdentity
    regions: tuple
    proof: str
    endpoint: Endpoint | None = None

    def __post_init__(self):
        _check_transport("Offer.transport", self.transport)
        _check_hex("Offer.proof", self.proof)
        if not isinstance(self.ring, RingIdentity):
            raise HandshakeError(f"Offer.ring must be a RingIdentity (got {self.ring!r})")
        if (self.transport == RDMA) != isinstance(self.endpoint, Endpoint):
            raise HandshakeError("an Offer carries the engine's QP Endpoint for rdma, and none for ipc")
        self._check_regions()

    def _check_regions(self) -> None:
        kinds = _TRANSPORT_REGIONS[self.transport]
        if not isinstance(self.regions, tuple) or not 1 <= len(self.regions) <= MAX_REGIONS:
            raise HandshakeError(f"Offer.regions must be a tuple of 1 to {MAX_REGIONS} regions (got {self.regions!r})")
        end = 0
        for k, region in enumerate(self.regions):
            if not isinstance(region, kinds):
                raise HandshakeError(f"Offer.regions[{k}] is a {type(region).__name__}; {self.transport} offers "
                                     f"{' or '.join(kind.__name__ for kind in kinds)}")
            if region.start != end or region.start % REGION_ALIGN:
                raise HandshakeError(f"Offer.regions[{k}] starts at {region.start}; the regions must tile the ring "
                                     f"in order from 0 on {REGION_ALIGN}-byte boundaries (expected {end})")
            end = region.start + region.size
        if end != self.ring.size:
            raise HandshakeError(f"Offer.regions cover [0, {end}) but the ring is {self.ring.size} bytes")


@dataclass(frozen=True)
class Reject:
    """Why the peer cannot be served."""

    reason: str

    def __post_init__(self):
        if not isinstance(self.reason, str) or not self.reason:
            raise HandshakeError(f"Reject.reason must be a non-empty string (got {self.reason!r})")


MESSAGE_TYPES = {"challenge": Challenge, "hello": Hello, "offer": Offer, "reject": Reject}
_TYPE_NAMES = {cls: name for name, cls in MESSAGE_TYPES.items()}


# -- encoding ---------------------------------------------------------------------------------------------------

def encode(message) -> bytes:
    """The UTF-8 JSON of a ``Challenge``, ``Hello``, ``Offer`` or ``Reject``."""
    obj = {"blink_handshake": HANDSHAKE_VERSION, "type": _TYPE_NAMES[type(message)], **_to_json(message)}
    return json.dumps(obj, separators=(",", ":")).encode()


def _to_json(value):
    if isinstance(value, (*MESSAGE_TYPES.values(), Endpoint)):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, RingIdentity):
        return {"magic": value.magic, "version": value.version, "size": value.size,
                "geometry": asdict(value.geometry)}
    if isinstance(value, tuple(REGION_KINDS.values())):
        kind = next(name for name, cls in REGION_KINDS.items() if isinstance(value, cls))
        body = {f.name: getattr(value, f.name) for f in fields(value)}
        if "handle" in body:
            body["handle"] = body["handle"].hex()
        return {"kind": kind, **body}
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    return value


# -- decoding ---------------------------------------------------------------------------------------------------

def decode(payload: bytes):
    """The message in ``payload``; ``HandshakeError`` naming what is wrong with it."""
    try:
        obj = json.loads(payload.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HandshakeError(f"the peer's setup message is not UTF-8 JSON ({e})") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"the peer's setup message is a JSON {type(obj).__name__}, not an object")
    version = obj.get("blink_handshake")
    if version != HANDSHAKE_VERSION:
        raise HandshakeError(f"the peer speaks handshake version {version!r}, this blink {HANDSHAKE_VERSION}: run "
                             "the agent and the engine from the same blink version")
    cls = MESSAGE_TYPES.get(obj.get("type"))
    if cls is None:
        raise HandshakeError(f"unknown setup message type {obj.get('type')!r} (expected one of "
                             f"{sorted(MESSAGE_TYPES)})")
    body = {k: v for k, v in obj.items() if k not in ("blink_handshake", "type")}
    return _build(cls, body, _TYPE_NAMES[cls])


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise HandshakeError(f"the peer's setup message repeats a key ({sorted(keys)})")
    return dict(pairs)


def _build(cls, obj, where: str):
    """``cls(**obj)`` with nested messages decoded, after checking that ``obj`` has exactly ``cls``'s fields."""
    if not isinstance(obj, dict):
        raise HandshakeError(f"{where} must be a JSON object (got {obj!r})")
    names = [f.name for f in fields(cls)]
    if set(obj) != set(names):
        missing, unknown = sorted(set(names) - set(obj)), sorted(set(obj) - set(names))
        raise HandshakeError(f"{where} must have exactly the keys {names} (missing {missing}, unknown {unknown})")
    values = dict(obj)
    if "endpoint" in values and values["endpoint"] is not None:
        values["endpoint"] = _build(Endpoint, values["endpoint"], f"{where}.endpoint")
    if cls is Offer:
        values["ring"] = _ring(values["ring"], f"{where}.ring")
        values["regions"] = _regions(values["regions"], f"{where}.regions")
    return cls(**values)


def _ring(obj, where: str) -> RingIdentity:
    if not isinstance(obj, dict) or not isinstance(obj.get("geometry"), dict):
        raise HandshakeError(f"{where} must be an object with a geometry object (got {obj!r})")
    geometry = _build_geometry(obj["geometry"], f"{where}.geometry")
    return _build(RingIdentity, {**obj, "geometry": geometry}, where)


def _build_geometry(obj: dict, where: str) -> RingGeometry:
    names = [f.name for f in fields(RingGeometry)]
    if set(obj) != set(names):
        raise HandshakeError(f"{where} must have exactly the keys {names} (got {sorted(obj)})")
    try:
        return RingGeometry(**obj)
    except ValueError as e:
        raise HandshakeError(f"{where}: {e}") from None


def _regions(items, where: str) -> tuple:
    if not isinstance(items, list):
        raise HandshakeError(f"{where} must be a JSON list (got {items!r})")
    regions = []
    for k, item in enumerate(items):
        cls = REGION_KINDS.get(item.get("kind")) if isinstance(item, dict) else None
        if cls is None:
            raise HandshakeError(f"{where}[{k}] must be an object whose kind is one of {sorted(REGION_KINDS)} "
                                 f"(got {item!r})")
        body = {key: value for key, value in item.items() if key != "kind"}
        if cls is CudaRegion and isinstance(body.get("handle"), str):
            try:
                body["handle"] = bytes.fromhex(body["handle"])
            except ValueError:
                raise HandshakeError(f"{where}[{k}].handle must be hex digits (got {body['handle']!r})") from None
        regions.append(_build(cls, body, f"{where}[{k}]"))
    return tuple(regions)
