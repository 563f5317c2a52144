"""What the setup messages carry (``blink.nic.remote.wire``): the ring's identity, the regions that hold its bytes
(rdma: address + rkey; ipc: a shared-memory object or a CUDA IPC handle) and a queue pair's endpoint.

Each is a frozen dataclass checked at construction, so a value decoded from a peer is as valid as one made here:
ints that are ints (not bools or floats) within their ``LIMITS``, strings in their formats. Failures:
``HandshakeError`` naming the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from blink.errors import HandshakeError
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import REGION_ALIGN, RingLayout

MTUS = (256, 512, 1024, 2048, 4096)     # the IB path MTUs (ibv_mtu), in bytes
_GID = re.compile(r"[0-9a-f]{4}(:[0-9a-f]{4}){7}")      # pyverbs' text form of a GID
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_PCI_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")
CUDA_IPC_HANDLE_BYTES = 64             # sizeof(CUipcMemHandle)


def check_int(where: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise HandshakeError(f"{where} must be an int in [{lo}, {hi}] (got {value!r})")


def check_str(where: str, value, pattern: re.Pattern, form: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise HandshakeError(f"{where} must be {form} (got {value!r})")


def check_fields(obj) -> None:
    """Validate every int field of a dataclass against its ``LIMITS``."""
    for name, (lo, hi) in obj.LIMITS.items():
        check_int(f"{type(obj).__name__}.{name}", getattr(obj, name), lo, hi)


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
        check_fields(self)
        check_str("Endpoint.gid", self.gid, _GID, "8 groups of 4 lower-case hex digits (0000:...:ffff:c0a8:0101)")
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
        check_fields(self)
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
        check_fields(self)
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
        check_fields(self)
        check_str("ShmRegion.name", self.name, _SHM_NAME, "a shared-memory file name of letters, digits, '._-'")


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
        check_fields(self)
        if not isinstance(self.handle, bytes) or len(self.handle) != CUDA_IPC_HANDLE_BYTES:
            raise HandshakeError(f"CudaRegion.handle must be {CUDA_IPC_HANDLE_BYTES} bytes (got {self.handle!r})")
        check_str("CudaRegion.pci_bus_id", self.pci_bus_id, _PCI_BUS_ID, "a PCI bus id like '0000:1b:00.0'")

