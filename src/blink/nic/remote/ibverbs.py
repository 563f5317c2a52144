"""The verbs layer on a real RDMA device, through pyverbs (rdma-core's Python bindings, imported lazily so that
``import blink`` never needs rdma-core).

``PyverbsVerbs`` (the agent's side): a device context and PD, a staging buffer registered as a plain MR, a CQ and
an RC QP. ``PyverbsTarget`` (the engine's side): the ring's segments registered for remote read and write (host
memory: a plain MR over the pinned mapping; GPU memory: a ``DmaBufMR`` over the dma-buf fd the CUDA driver exports,
or, without dma-buf, a plain MR over the device pointer, which needs nvidia-peermem), and one QP per agent.

Neither registration asks for ``IBV_ACCESS_RELAXED_ORDERING``: it would let the NIC's PCIe writes pass each other,
and the ring's "payload before state word" rests on them landing in order. QP settings are ibv_rc_pingpong's
(``QP_*`` below); both sides use the smaller MTU and the smaller RDMA READ depth of the two endpoints.
"""
from __future__ import annotations

import ctypes
import importlib
import mmap
import random
from contextlib import contextmanager
from dataclasses import dataclass

from blink.errors import RdmaError
from blink.nic.remote.segments import DeviceSegment, HostSegment
from blink.nic.remote.verbs import READ, WRITE, Completion, Verbs, VerbsTarget, WorkRequest
from blink.nic.remote.regions import Endpoint, RdmaRegion

QP_TIMEOUT = 14          # local ACK timeout 4.096 us * 2**14 = 67 ms per try
QP_RETRY_CNT = 7         # tries before IBV_WC_RETRY_EXC_ERR (~0.5 s)
QP_RNR_RETRY = 7         # no SENDs are used, so receiver-not-ready never happens; 7 = retry forever
QP_MIN_RNR_TIMER = 12
MAX_RD_ATOMIC = 16       # RDMA READs in flight per QP, at most the device's max_qp_rd_atom
INSTALL = ("install rdma-core and its Python bindings (Debian/Ubuntu: apt install rdma-core ibverbs-providers "
           "python3-pyverbs; on a BlueField they come with the DOCA / MLNX_OFED image)")


def require_pyverbs():
    """Import and return ``pyverbs``, or raise ``ImportError`` saying what is missing and how to get it."""
    try:
        return importlib.import_module("pyverbs")
    except ImportError as e:
        raise ImportError(
            f"the RDMA transport needs pyverbs (the Python bindings of rdma-core), which is not importable here "
            f"({e}): {INSTALL}, or use --transport ipc on the engine's own host.") from e


@contextmanager
def _verbs_call(what: str):
    """Turn a pyverbs error inside the block into an ``RdmaError`` that names ``what`` was being done."""
    from pyverbs.pyverbs_error import PyverbsError

    try:
        yield
    except PyverbsError as e:
        raise RdmaError(f"{what} failed: {e}") from e


@dataclass(frozen=True)
class DeviceConfig:
    """Which RDMA device, port and GID the QPs use. ``device=None``: the only device there is. ``gid_index``: the
    port's GID table entry (``show_gids`` lists them; use a RoCE v2 entry with the interface's IP address)."""

    device: str | None = None
    port: int = 1
    gid_index: int = 0

    def __post_init__(self):
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise ValueError(f"DeviceConfig.device must be None or a device name like 'mlx5_0' (got {self.device!r})")
        for name, lo, hi in (("port", 1, 255), ("gid_index", 0, 0xFFFF)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"DeviceConfig.{name} must be an int in [{lo}, {hi}] (got {value!r})")


def _address_of(buffer) -> int:
    """The address of a writable buffer (an mmap or a memoryview of one), without keeping an export of it."""
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _mtus() -> dict[int, int]:
    """Path MTU in bytes -> ``ibv_mtu`` code."""
    import pyverbs.enums as e

    return {256: e.IBV_MTU_256, 512: e.IBV_MTU_512, 1024: e.IBV_MTU_1024, 2048: e.IBV_MTU_2048, 4096: e.IBV_MTU_4096}


def rts_attributes(config: DeviceConfig, local: Endpoint, remote: Endpoint):
    """The ``QPAttr`` that takes an RC QP from INIT through RTR to RTS, from ``local`` towards ``remote``: the
    smaller MTU and READ depth of the two, our PSN for what we send and theirs for what we receive, a global route
    to their GID (RoCE needs one; on InfiniBand it names the same port as the LID)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=config.port)
    attr.path_mtu = _mtus()[min(local.mtu, remote.mtu)]
    attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote.qp_num, remote.psn, local.psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = min(local.max_rd_atomic, remote.max_rd_atomic)
    attr.min_rnr_timer, attr.timeout = QP_MIN_RNR_TIMER, QP_TIMEOUT
    attr.retry_cnt, attr.rnr_retry = QP_RETRY_CNT, QP_RNR_RETRY
    route = GlobalRoute(dgid=GID(val=remote.gid), sgid_index=config.gid_index)
    attr.ah_attr = AHAttr(port_num=config.port, is_global=1, gr=route, dlid=remote.lid)
    return attr


def send_request(request: WorkRequest, address: int, lkey: int):
    """The pyverbs ``SendWR`` of ``request``, whose staging buffer starts at ``address`` under ``lkey``."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    opcode = {READ: e.IBV_WR_RDMA_READ, WRITE: e.IBV_WR_RDMA_WRITE}[request.opcode]
    sge = SGE(address + request.local_offset, request.length, lkey)
    wr = SendWR(wr_id=request.wr_id, opcode=opcode, num_sge=1, sg=[sge],
                send_flags=e.IBV_SEND_SIGNALED if request.signaled else 0)
    wr.set_wr_rdma(request.rkey, request.remote_addr)
    return wr


class _Device:
    """An opened device: context, protection domain, the port's LID and MTU, the GID at ``gid_index``."""

    def __init__(self, config: DeviceConfig):
        require_pyverbs()
        import pyverbs.enums as e
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError

        self.config = config
        try:
            names = [device.name.decode() for device in get_device_list()]
        except PyverbsError:
            names = []
        if not names:
            raise RdmaError("no RDMA device here (ibv_devices lists none): load the NIC's RDMA driver (mlx5_ib on "
                            f"ConnectX and BlueField), or run this side on a host with an RDMA NIC; {INSTALL}")
        if config.device is None and len(names) > 1:
            raise RdmaError(f"this host has several RDMA devices {names}: name the one to use")
        name = config.device or names[0]
        if name not in names:
            raise RdmaError(f"no RDMA device named {name!r} here; this host has {names}")
        with _verbs_call(f"opening RDMA device {name}"):
            self.context = Context(name=name)
        try:
            with _verbs_call(f"querying port {config.port} and GID {config.gid_index} of RDMA device {name}"):
                self.pd = PD(self.context)
                port = self.context.query_port(config.port)
                attributes = self.context.query_device()
                self.gid = self.context.query_gid(config.port, config.gid_index).gid
            if port.state != e.IBV_PORT_ACTIVE:
                raise RdmaError(f"port {config.port} of {name} is not ACTIVE (state {port.state}): check the link "
                                "(ibv_devinfo)")
        except BaseException:
            self.context.close()
            raise
        self.mtu = next(size for size, code in _mtus().items() if code == port.active_mtu)
        self.lid = port.lid
        self.max_rd_atomic = min(MAX_RD_ATOMIC, attributes.max_qp_rd_atom, attributes.max_qp_init_rd_atom)
        self.name = name

    def create_qp(self, max_send_wr: int, access: int):
        """A CQ and an RC QP in INIT whose send queue holds ``max_send_wr`` requests."""
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        with _verbs_call(f"creating an RC queue pair on {self.name}"):
            # A failed request also completes when unsignaled, so the CQ holds a whole send queue of them.
            cq = CQ(self.context, 2 * max_send_wr, None, None, 0)
            cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            attr = QPAttr(port_num=self.config.port)
            attr.qp_access_flags = access
            qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0), attr)
        endpoint = Endpoint(qp_num=qp.qp_num, psn=random.getrandbits(24), gid=self.gid, lid=self.lid, mtu=self.mtu,
                            max_rd_atomic=self.max_rd_atomic)
        return cq, qp, endpoint

    def connect(self, qp, local: Endpoint, remote: Endpoint) -> None:
        """INIT -> RTR -> RTS towards ``remote``."""
        with _verbs_call(f"connecting QP {local.qp_num} to QP {remote.qp_num} at {remote.gid}"):
            qp.to_rts(rts_attributes(self.config, local, remote))

    def close(self) -> None:
        self.context.close()        # pyverbs closes what was created from the context (QPs, CQs, MRs, PD) first


class PyverbsVerbs(Verbs):
    """The agent's RC QP on ``config``'s device, with a ``staging_bytes`` staging buffer registered for local
    write (RDMA READs land in it)."""

    def __init__(self, config: DeviceConfig, staging_bytes: int, max_send_wr: int):
        self._device = _Device(config)          # first: it says what is missing when pyverbs is
        import pyverbs.enums as e
        from pyverbs.mr import MR

        self._buffer = mmap.mmap(-1, staging_bytes)
        self.staging = memoryview(self._buffer)
        self.max_send_wr = max_send_wr
        self._address = _address_of(self._buffer)
        try:
            with _verbs_call(f"registering {staging_bytes} staging bytes on {self._device.name}"):
                self._mr = MR(self._device.pd, staging_bytes, e.IBV_ACCESS_LOCAL_WRITE, address=self._address)
            self._cq, self._qp, self.endpoint = self._device.create_qp(max_send_wr, 0)
        except BaseException:
            self.close()
            raise

    @classmethod
    def factory(cls, config: DeviceConfig):
        """A ``verbs_factory(staging_bytes, max_send_wr)`` for ``config``'s device."""
        return lambda staging_bytes, max_send_wr: cls(config, staging_bytes, max_send_wr)

    def connect(self, remote: Endpoint) -> None:
        self._device.connect(self._qp, self.endpoint, remote)

    def post(self, request: WorkRequest) -> None:
        with _verbs_call(f"ibv_post_send of {request.opcode} {request.wr_id}"):
            self._qp.post_send(send_request(request, self._address, self._mr.lkey), None)

    def poll(self, max_entries: int) -> list[Completion]:
        with _verbs_call("ibv_poll_cq"):
            _, completions = self._cq.poll(max_entries)
        return [Completion(wc.wr_id, wc.status, wc.vendor_err) for wc in completions]

    def close(self) -> None:
        self._device.close()
        self.staging.release()
        self._buffer.close()


class PyverbsTarget(VerbsTarget):
    """The engine's side on ``config``'s device."""

    def __init__(self, config: DeviceConfig):
        self._device = _Device(config)          # first: it says what is missing when pyverbs is
        import pyverbs.enums as e

        self._access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self._resources: list = []        # MRs, CQs and QPs: alive until close(), the NIC serves agents from them

    def register(self, segment) -> RdmaRegion:
        from pyverbs.mr import MR, DmaBufMR

        where = f"registering ring bytes [{segment.start}, {segment.start + segment.size}) on {self._device.name}"
        with _verbs_call(where):
            if isinstance(segment, HostSegment):
                mr = MR(self._device.pd, segment.size, self._access, address=_address_of(segment.memory.buffer))
            elif isinstance(segment, DeviceSegment) and segment.dmabuf_fd is not None:
                mr = DmaBufMR(self._device.pd, segment.size, self._access, dmabuf=segment.dmabuf_fd, offset=0)
            elif isinstance(segment, DeviceSegment):
                mr = MR(self._device.pd, segment.size, self._access, address=segment.address)   # nvidia-peermem
            else:
                raise ValueError(f"cannot register a {type(segment).__name__}: a HostSegment or DeviceSegment")
        self._resources.append(mr)
        return RdmaRegion(start=segment.start, size=segment.size, addr=mr.buf, rkey=mr.rkey)

    def accept(self, remote: Endpoint) -> Endpoint:
        cq, qp, endpoint = self._device.create_qp(1, self._access)
        self._resources += [cq, qp]
        self._device.connect(qp, endpoint, remote)
        return endpoint

    def close(self) -> None:
        self._resources.clear()
        self._device.close()
