"""The setup handshake's messages: what an agent and an engine exchange once, before any request.

Three messages, each a JSON object with ``"blink_handshake": HANDSHAKE_VERSION`` and a ``"type"``:

- ``hello`` (agent -> engine): the transport it wants (``rdma`` or ``ipc``), its ring protocol version, and its QP's
  ``Endpoint`` (rdma) or its host's boot id (ipc: the engine's memory can be mapped only on the engine's host);
- ``offer`` (engine -> agent): the ring's identity (magic, version, geometry, size), the regions that hold its bytes
  (rdma: remote address + rkey each; ipc: a shared-memory name or a CUDA IPC handle each) and, for rdma, the
  engine's QP ``Endpoint``;
- ``reject`` (either way): why the peer cannot be served, in words.

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
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import REGION_ALIGN, RingLayout

HANDSHAKE_VERSION = 2       # 2: ShmRegion.offset
RDMA, IPC = "rdma", "ipc"
TRANSPORTS = (RDMA, IPC)
MTUS = (256, 512, 1024, 2048, 4096)     # the IB path MTUs (ibv_mtu), in bytes
MAX_REGIONS = 16
_GID = re.compile(r"[0-9a-f]{4}(:[0-9a-f]{4}){7}")      # pyverbs' text form of a GID
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_PCI_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")
CUDA_IPC_HANDLE_BYTES = 64             # sizeof(CUipcMemHandle)


def _check_int(where: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise HandshakeError(f"{where} must be an int in [{lo}, {hi}] (got {value!r})")


def _check_str(where: str, value, pattern: re.Pattern, form: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise HandshakeError(f"{where} must be {form} (got {value!r})")


def _check_fields(obj) -> None:
    """Validate every int field of a wire dataclass against its ``LIMITS``."""
    for name, (lo, hi) in obj.LIMITS.items():
        _check_int(f"{type(obj).__name__}.{name}", getattr(obj, name), lo, hi)


@dataclass(frozen=True)
class Endpoint:
    """An RC queue pair's address: QP number, first packet sequence number, GID and LID of its port, the port's
    active MTU in bytes, and how many RDMA READs it handles at once (each side uses the smaller of the two)."""

    qp_num: int
    psn: int
    gid: str
    lid: int
    mtu: int
    max_rd_atomic: int

    LIMITS = {"qp_num": (2, (1 << 24) - 1), "psn": (0, (1 << 24) - 1), "lid": (0, 0xFFFF), "max_rd_atomic": (1, 255)}

    def __post_init__(self):
        _check_fields(self)
        _check_str("Endpoint.gid", self.gid, _GID, "8 groups of 4 lower-case hex digits (0000:...:ffff:c0a8:0101)")
        if set(self.gid) <= {"0", ":"}:
            raise HandshakeError("Endpoint.gid is all zeros: the port has no GID at that index (show_gids)")
        if self.mtu not in MTUS:
            raise HandshakeError(f"Endpoint.mtu must be one of {MTUS} (got {self.mtu!r})")


@dataclass(frozen=True)
class RingIdentity:
    """Which ring is offered: its control block's magic and version, its geometry and its size in bytes."""

    magic: int
    version: int
    size: int
    geometry: RingGeometry

    LIMITS = {"magic": (0, 0xFFFFFFFF), "version": (0, 0xFFFFFFFF), "size": (REGION_ALIGN, 1 << 62)}

    def __post_init__(self):
        _check_fields(self)
        if not isinstance(self.geometry, RingGeometry):
            raise HandshakeError(f"RingIdentity.geometry must be a RingGeometry (got {self.geometry!r})")
        if self.size != RingLayout(self.geometry).size:
            raise HandshakeError(f"RingIdentity.size is {self.size} but its geometry lays out "
                                 f"{RingLayout(self.geometry).size} bytes")

    @classmethod
    def of(cls, geometry: RingGeometry) -> RingIdentity:
        return cls(control.MAGIC, control.VERSION, RingLayout(geometry).size, geometry)

    def check_served_by_this_blink(self) -> None:
        """``HandshakeError`` unless this blink's agent can drive the ring (magic and protocol version)."""
        if self.magic != control.MAGIC:
            raise HandshakeError(f"the engine offers a region with magic {self.magic:#x}, not a blink ring "
                                 f"({control.MAGIC:#x})")
        if self.version != control.VERSION:
            raise HandshakeError(f"the engine's ring speaks protocol version {self.version}, this agent "
                                 f"{control.VERSION}: run the agent and the engine from the same blink version")


@dataclass(frozen=True)
class RdmaRegion:
    """Ring bytes ``[start, start + size)`` are at ``addr`` in the engine's NIC's address space, under ``rkey``."""

    start: int
    size: int
    addr: int
    rkey: int

    LIMITS = {"start": (0, 1 << 62), "size": (1, 1 << 62), "addr": (0, (1 << 64) - 1), "rkey": (0, 0xFFFFFFFF)}

    def __post_init__(self):
        _check_fields(self)
        if self.addr + self.size > 1 << 64:
            raise HandshakeError(f"RdmaRegion [{self.addr:#x}, +{self.size}) runs past the 64-bit address space")


@dataclass(frozen=True)
class ShmRegion:
    """Ring bytes ``[start, start + size)`` are bytes ``[offset, offset + size)`` of the POSIX shared-memory object
    ``/dev/shm/<name>`` (same host): the whole ring at offset 0, or the output side of a ring whose request side is
    in GPU memory, at its own ring offset in the engine's shared-memory ring."""

    start: int
    size: int
    name: str
    offset: int = 0

    LIMITS = {"start": (0, 1 << 62), "size": (1, 1 << 62), "offset": (0, 1 << 62)}

    def __post_init__(self):
        _check_fields(self)
        _check_str("ShmRegion.name", self.name, _SHM_NAME, "a shared-memory file name of letters, digits, '._-'")


@dataclass(frozen=True)
class CudaRegion:
    """Ring bytes ``[start, start + size)`` are a GPU allocation exported with ``cuIpcGetMemHandle`` (``handle``,
    64 bytes) on the GPU at ``pci_bus_id`` (same host)."""

    start: int
    size: int
    handle: bytes
    pci_bus_id: str

    LIMITS = {"start": (0, 1 << 62), "size": (1, 1 << 62)}

    def __post_init__(self):
        _check_fields(self)
        if not isinstance(self.handle, bytes) or len(self.handle) != CUDA_IPC_HANDLE_BYTES:
            raise HandshakeError(f"CudaRegion.handle must be {CUDA_IPC_HANDLE_BYTES} bytes (got {self.handle!r})")
        _check_str("CudaRegion.pci_bus_id", self.pci_bus_id, _PCI_BUS_ID, "a PCI bus id like '0000:1b:00.0'")


REGION_KINDS = {"rdma": RdmaRegion, "shm": ShmRegion, "cuda": CudaRegion}
_TRANSPORT_REGIONS = {RDMA: (RdmaRegion,), IPC: (ShmRegion, CudaRegion)}


def _check_transport(where: str, transport) -> None:
    if transport not in TRANSPORTS:
        raise HandshakeError(f"{where} must be one of {TRANSPORTS} (got {transport!r})")


@dataclass(frozen=True)
class Hello:
    """The agent's request: a transport, its ring protocol version and its QP (rdma) or boot id (ipc)."""

    transport: str
    ring_version: int
    endpoint: Endpoint | None = None
    host: str | None = None

    def __post_init__(self):
        _check_transport("Hello.transport", self.transport)
        _check_int("Hello.ring_version", self.ring_version, 0, 0xFFFFFFFF)
        if self.transport == RDMA and (not isinstance(self.endpoint, Endpoint) or self.host is not None):
            raise HandshakeError("an rdma Hello carries the agent's QP Endpoint and no host")
        if self.transport == IPC:
            if self.endpoint is not None:
                raise HandshakeError("an ipc Hello carries the agent's host boot id and no Endpoint")
            _check_str("Hello.host", self.host, _BOOT_ID, "a boot id (/proc/sys/kernel/random/boot_id)")


@dataclass(frozen=True)
class Offer:
    """The engine's answer: the ring, the regions that tile it (in order, each on a ``REGION_ALIGN`` boundary,
    all of the transport's kinds) and, for rdma, the engine's QP."""

    transport: str
    ring: RingIdentity
    regions: tuple
    endpoint: Endpoint | None = None

    def __post_init__(self):
        _check_transport("Offer.transport", self.transport)
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


MESSAGE_TYPES = {"hello": Hello, "offer": Offer, "reject": Reject}
_TYPE_NAMES = {cls: name for name, cls in MESSAGE_TYPES.items()}


# -- encoding ---------------------------------------------------------------------------------------------------

def encode(message) -> bytes:
    """The UTF-8 JSON of a ``Hello``, ``Offer`` or ``Reject``."""
    obj = {"blink_handshake": HANDSHAKE_VERSION, "type": _TYPE_NAMES[type(message)], **_to_json(message)}
    return json.dumps(obj, separators=(",", ":")).encode()


def _to_json(value):
    if isinstance(value, (Hello, Offer, Reject, Endpoint)):
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
