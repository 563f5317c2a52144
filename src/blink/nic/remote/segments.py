"""Where the engine's ring bytes live, as the engine describes them to the code that exports them to agents.

The ring stays one byte-addressed region (``RingLayout``); its bytes may sit in several segments, each a contiguous
range ``[start, start + size)`` of ring offsets: in host memory (``HostSegment``: today's whole ring, or the output
side of a split ring) or in GPU memory (``DeviceSegment``: the request side of a split ring). Segments tile the ring
in order; each holds exactly its own bytes (ring offset ``start`` is the segment's first byte).
"""
from __future__ import annotations

from dataclasses import dataclass

from blink.ring.layout import REGION_ALIGN
from blink.ring.transport import RemoteMemory


def _check_start(owner: str, start: int) -> None:
    if not isinstance(start, int) or start < 0 or start % REGION_ALIGN:
        raise ValueError(f"{owner}.start must be a ring offset on a {REGION_ALIGN}-byte boundary (got {start!r})")


@dataclass(frozen=True)
class HostSegment:
    """Ring bytes ``[start, start + memory.size)`` in a host mapping this process has: a ``SharedMemory`` (which
    a same-host agent opens by name) or a ``LocalMemory`` (reachable by RDMA only)."""

    start: int
    memory: RemoteMemory

    def __post_init__(self):
        _check_start("HostSegment", self.start)
        if not hasattr(self.memory, "buffer"):
            raise ValueError(f"HostSegment.memory must be a mapped region (LocalMemory or SharedMemory), not "
                             f"{type(self.memory).__name__}")

    @property
    def size(self) -> int:
        return self.memory.size


@dataclass(frozen=True)
class DeviceSegment:
    """Ring bytes ``[start, start + size)`` in a GPU allocation at device address ``address`` (its base: CUDA IPC
    exports whole allocations), exported as the CUDA IPC ``ipc_handle`` of the GPU at ``pci_bus_id`` and, where
    the driver supports dma-buf, as the file descriptor ``dmabuf_fd`` (for ``ibv_reg_dmabuf_mr``; None: register
    ``address`` itself, which needs the nvidia-peermem kernel module)."""

    start: int
    size: int
    address: int
    ipc_handle: bytes
    pci_bus_id: str
    dmabuf_fd: int | None = None

    def __post_init__(self):
        _check_start("DeviceSegment", self.start)
        if not isinstance(self.size, int) or self.size < 1 or self.size % REGION_ALIGN:
            raise ValueError(f"DeviceSegment.size must be a positive multiple of {REGION_ALIGN} (got {self.size!r})")
        if not isinstance(self.address, int) or self.address <= 0:
            raise ValueError(f"DeviceSegment.address must be a device pointer (got {self.address!r})")


def check_tiling(segments, size: int) -> None:
    """``ValueError`` unless ``segments`` cover ``[0, size)`` in order, without gaps or overlaps."""
    end = 0
    for k, segment in enumerate(segments):
        if segment.start != end:
            raise ValueError(f"segment {k} starts at ring offset {segment.start}, expected {end}: segments must "
                             "tile the ring in order")
        end = segment.start + segment.size
    if end != size:
        raise ValueError(f"the segments cover [0, {end}) but the ring is {size} bytes")
