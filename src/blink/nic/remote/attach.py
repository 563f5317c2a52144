"""The ring across a process or machine boundary: the agent's ``open_remote`` (``blink agent --remote HOST:PORT``)
and the engine's ``RingListener`` (``blink engine --listen HOST:PORT``).

Both sides know the ring's secret (``blink.ring.secret``) and prove it to each other in the handshake
(``blink.nic.remote.proof``): the engine offers its ring only to an agent that proved it, and the agent takes only an
offer that proves it. The engine describes where its ring's bytes live (``segments``) and answers each proven hello
once:

- ``rdma``: the segments are registered with the engine's RDMA device on the first rdma hello (host memory as a
  plain MR, GPU memory through dma-buf), each agent gets a QP of its own, and the offer carries the addresses,
  rkeys and the QP's endpoint. From then on the engine's NIC serves the agent's READs and WRITEs by itself;
- ``ipc`` (same host only, checked by boot id): the offer names the shared-memory objects and CUDA IPC handles
  of the segments, and the agent maps them itself.

The agent connects, maps or connects what it was offered, and reads the control block through the new transport to
check that it reached the ring the offer describes (``RingMismatch`` naming the first field that differs).
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from blink.errors import HandshakeError, RdmaError, RingMismatch
from blink.nic.remote.handshake import SETUP_TIMEOUT_S, connect, serve_handshake
from blink.nic.remote.rdma import RdmaConfig, RdmaMemory
from blink.nic.remote.segments import DeviceSegment, check_tiling

from blink.nic.remote.regions import CudaRegion, RingIdentity, ShmRegion
from blink.nic.remote.wire import IPC, RDMA, TRANSPORTS, Hello, Offer
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.split import SplitMemory, Window
from blink.ring.transport import RemoteMemory, SharedMemory

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
log = logging.getLogger("blink")


def boot_id() -> str:
    """This host's boot id: two processes share memory only if theirs are equal."""
    return BOOT_ID.read_text().strip()


# -- the agent's side -------------------------------------------------------------------------------------------

def open_remote(address: str, transport: str = RDMA, *, ring_secret: str | None, rdma: RdmaConfig = RdmaConfig(),
                device=None, verbs_factory=None, timeout_s: float = SETUP_TIMEOUT_S) -> RemoteMemory:
    """The ring of the engine listening at ``address`` (``HOST:PORT``), over ``transport``, checked; the engine and
    this agent prove each other they know ``ring_secret`` (``blink.ring.secret.given``; None: this agent knows none,
    and the engine rejects it saying where the secret comes from).

    rdma: the agent's QP comes from ``verbs_factory(staging_bytes, max_send_wr)``; by default a pyverbs QP on
    ``device`` (an ``ibverbs.DeviceConfig``; None: the only device there is).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {TRANSPORTS} (got {transport!r})")
    if transport == RDMA:
        memory, offer = _open_rdma(address, ring_secret, rdma, device, verbs_factory, timeout_s)
    else:
        offer = connect(address, functools.partial(Hello, IPC, control.VERSION, host=boot_id()), ring_secret,
                        timeout_s=timeout_s)
        offer.ring.check_served_by_this_blink()
        memory = _open_ipc(offer)
    try:
        _verify(memory, offer.ring)
    except BaseException:
        memory.close()
        raise
    log.info("attached to the ring at %s over %s: %d slots, %.1f MiB in %d region(s)", address, transport,
             offer.ring.geometry.n_slots, offer.ring.size / 2**20, len(offer.regions))
    return memory


def _open_rdma(address: str, ring_secret: str | None, config: RdmaConfig, device, verbs_factory, timeout_s: float):
    if verbs_factory is None:
        from blink.nic.remote.ibverbs import DeviceConfig, PyverbsVerbs

        verbs_factory = PyverbsVerbs.factory(device or DeviceConfig())
    try:
        verbs = verbs_factory(config.staging_bytes, config.send_queue_depth)
    except ImportError as e:            # no pyverbs: a one-line error like every other setup failure
        raise RdmaError(str(e)) from None
    try:
        offer = connect(address, functools.partial(Hello, RDMA, control.VERSION, endpoint=verbs.endpoint),
                        ring_secret, timeout_s=timeout_s)
        offer.ring.check_served_by_this_blink()
        verbs.connect(offer.endpoint)
        return RdmaMemory(verbs, offer.regions, offer.ring.size, config), offer
    except BaseException:
        verbs.close()
        raise


def _open_ipc(offer: Offer) -> RemoteMemory:
    opened = []
    try:
        for region in offer.regions:
            opened.append((region.start, _map_region(region)))
    except BaseException:
        for _, memory in opened:
            memory.close()
        raise
    return opened[0][1] if len(opened) == 1 else SplitMemory(opened)


def _map_region(region) -> RemoteMemory:
    if isinstance(region, ShmRegion):
        return _map_shm(region)
    from blink.nic.remote.ipc import CudaIpcMemory

    return CudaIpcMemory(region.handle, region.size, region.pci_bus_id)


def _map_shm(region: ShmRegion) -> RemoteMemory:
    """The shared-memory object of ``region``, or the window of it that holds the region's bytes."""
    shared = SharedMemory.open(region.name)
    if region.offset == 0 and region.size == shared.size:
        return shared
    if region.offset + region.size > shared.size:
        shared.close()
        raise RingMismatch(f"the offer places ring bytes at [{region.offset}, {region.offset + region.size}) of "
                           f"/dev/shm/{region.name}, which holds {shared.size} bytes")
    return Window(shared, region.offset, region.size, owns=True)


def _verify(memory: RemoteMemory, ring: RingIdentity) -> None:
    """The region the transport reaches is the ring the offer describes."""
    if memory.size != ring.size:
        raise RingMismatch(f"the transport reaches {memory.size} bytes but the offered ring is {ring.size}")
    control.verify(memory.read(0, control.CONTROL_DTYPE.itemsize), ring.geometry)


# -- the engine's side ------------------------------------------------------------------------------------------

class RingExport:
    """Answers agents' hellos for the ring of ``geometry`` whose bytes are in ``segments`` (``HostSegment`` /
    ``DeviceSegment``, tiling the ring). ``target_factory()`` opens the RDMA side (a ``VerbsTarget``) at the
    first rdma hello; None: rdma is not offered. ``close()`` destroys the agents' QPs and registrations."""

    def __init__(self, geometry: RingGeometry, segments, *, target_factory=None):
        self.ring = RingIdentity.of(geometry)
        check_tiling(segments, self.ring.size)
        self.segments = tuple(segments)
        self._target_factory = target_factory
        self._target = None
        self._regions = None        # the segments' RdmaRegions, registered once for every agent
        # The device segments' dma-buf fds: this export's to close, once registered (the MR holds the dma-buf) or
        # at close() if no rdma agent came.
        self._dmabuf_fds = [segment.dmabuf_fd for segment in self.segments
                            if isinstance(segment, DeviceSegment) and segment.dmabuf_fd is not None]

    @property
    def transports(self) -> tuple[str, ...]:
        return TRANSPORTS if self._target_factory is not None else (IPC,)

    def answer(self, hello: Hello, proof: str) -> Offer:
        """The ``Offer`` for ``hello`` (whose proof the handshake checked), carrying ``proof`` (the engine's);
        ``HandshakeError`` (sent back as the reject's reason) if it cannot be served."""
        if hello.ring_version != control.VERSION:
            raise HandshakeError(f"the agent speaks ring protocol version {hello.ring_version}, this engine "
                                 f"{control.VERSION}: run the agent and the engine from the same blink version")
        return self._offer_rdma(hello, proof) if hello.transport == RDMA else self._offer_ipc(hello, proof)

    def _offer_rdma(self, hello: Hello, proof: str) -> Offer:
        if self._target_factory is None:
            raise HandshakeError("this engine was started without RDMA: use --transport ipc on its host, or "
                                 "restart it with an RDMA device")
        if self._target is None:
            self._open_target()
        return Offer(RDMA, self.ring, self._regions, proof, self._target.accept(hello.endpoint))

    def _open_target(self) -> None:
        try:
            target = self._target_factory()
        except (ImportError, RdmaError) as e:
            raise HandshakeError(f"the engine cannot serve RDMA: {e}") from None
        try:
            self._regions = tuple(target.register(segment) for segment in self.segments)
        except BaseException:
            target.close()
            raise
        self._target = target
        self._close_dmabuf_fds()

    def _close_dmabuf_fds(self) -> None:
        while self._dmabuf_fds:
            os.close(self._dmabuf_fds.pop())

    def _offer_ipc(self, hello: Hello, proof: str) -> Offer:
        if hello.host != boot_id():
            raise HandshakeError("the agent runs on another host than the engine (their boot ids differ), and ipc "
                                 "maps the engine's memory: use --transport rdma")
        return Offer(IPC, self.ring, tuple(_ipc_region(segment) for segment in self.segments), proof)

    def close(self) -> None:
        self._close_dmabuf_fds()
        if self._target is not None:
            self._target.close()
            self._target = self._regions = None


def _ipc_region(segment):
    if isinstance(segment, DeviceSegment):
        return CudaRegion(segment.start, segment.size, segment.ipc_handle, segment.pci_bus_id)
    memory, offset = segment.memory, 0
    if isinstance(memory, Window):          # the output side of a ring whose request side is in GPU memory
        memory, offset = memory.memory, memory.start
    if isinstance(memory, SharedMemory):
        return ShmRegion(segment.start, segment.size, memory.name, offset)
    raise HandshakeError(f"ring bytes [{segment.start}, {segment.start + segment.size}) are in the engine's private "
                         "memory, which no other process can map: start the engine on a shared-memory ring")


class RingListener:
    """The engine's setup-only listener on ``address`` for one ring (a ``RingExport`` behind a
    ``HandshakeServer``), for agents that prove they know ``ring_secret``. ``close()`` stops listening and destroys
    the agents' QPs."""

    def __init__(self, address: str, export: RingExport, ring_secret: str):
        self.export = export
        self.server = serve_handshake(address, export.answer, ring_secret)
        log.info("listening for agents on %s:%d (%s)", *self.server.address, ", ".join(export.transports))

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def close(self) -> None:
        self.server.close()
        self.export.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def listen_on_ring(address: str, segments, geometry: RingGeometry, *, ring_secret: str, rdma_device=None,
                   target_factory=None) -> RingListener:
    """A ``RingListener`` for the ring of ``geometry`` whose bytes are in ``segments`` (``HostSegment`` /
    ``DeviceSegment``: the engine's ``EngineCore.segments()``), for agents that prove they know ``ring_secret``.
    RDMA is offered through ``target_factory``, or a pyverbs target on ``rdma_device`` (an ``ibverbs.DeviceConfig``)
    when one is given; with neither, ipc only."""
    if target_factory is None and rdma_device is not None:
        from blink.nic.remote.ibverbs import PyverbsTarget

        target_factory = functools.partial(PyverbsTarget, rdma_device)
    return RingListener(address, RingExport(geometry, segments, target_factory=target_factory), ring_secret)
