"""A recording fake of the RDMA hardware, for machines without a device: initiators (``RecordingVerbs``) post work
requests that a fake NIC records and applies, in posting order, to the memory a target (``RecordingTarget``)
registered; a ``RecordingFabric`` is the network between them.

It keeps the behaviour the transport depends on and that tests must be able to break:

- nothing a request does is visible until the NIC executes it, and it executes only when the initiator polls (or
  ``progress()`` is called): a transport that forgets to wait sees stale memory;
- requests execute strictly in posting order and read the staging buffer when they execute, not when posted: a
  transport that reuses a cell too early sends the wrong bytes;
- completions: one per signaled request, and one for a failed request whether signaled or not; a polled
  completion frees its send-queue entry and every earlier one; posting into a full send queue is refused;
- failures: an unknown rkey or an address outside the registered region -> ``IBV_WC_REM_ACCESS_ERR``; a QP number,
  GID or PSN that does not reach a target QP connected back to this initiator -> ``IBV_WC_RETRY_EXC_ERR``; a local
  range outside staging -> ``IBV_WC_LOC_PROT_ERR``; ``inject(status, after)`` fails a later request; after any
  failure the QP is in the error state and every later request completes with ``IBV_WC_WR_FLUSH_ERR``;
  ``stall()`` stops the NIC (a dead link) so waits time out.
"""
from __future__ import annotations

import itertools
import random
from collections import deque

from blink.errors import RdmaError
from blink.nic.remote.segments import HostSegment
from blink.nic.remote.verbs import (READ, WC_LOC_PROT_ERR, WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR, WC_SUCCESS,
                                    WC_WR_FLUSH_ERR, Completion, Verbs, VerbsTarget, WorkRequest)
from blink.nic.remote.regions import Endpoint, RdmaRegion

MTU = 4096
MAX_RD_ATOMIC = 16
_REGION_SPACING = 1 << 40      # fake addresses of two regions are far apart: a stray address hits neither


class RecordingFabric:
    """Queue pairs of the fake targets by (GID, QP number); initiators look their peer up at execution time, as
    packets would find it."""

    def __init__(self, seed: int = 0):
        self.random = random.Random(seed)
        self._qps: dict[tuple[str, int], tuple[Endpoint, Endpoint, RecordingTarget]] = {}
        self._qp_numbers = itertools.count(0x100)
        self._hosts = itertools.count(1)

    def endpoint(self, gid: str) -> Endpoint:
        """A fresh QP's endpoint on the port with ``gid``."""
        return Endpoint(qp_num=next(self._qp_numbers), psn=self.random.getrandbits(24), gid=gid, lid=0, mtu=MTU,
                        max_rd_atomic=MAX_RD_ATOMIC)

    def new_gid(self) -> str:
        return f"fe80:0000:0000:0000:0000:0000:0000:{next(self._hosts):04x}"

    def target(self) -> RecordingTarget:
        """An engine-side target on a new fake port (a ``target_factory``)."""
        return RecordingTarget(self)

    def initiator(self, staging_bytes: int, max_send_wr: int) -> RecordingVerbs:
        """An agent-side QP on a new fake port (a ``verbs_factory``)."""
        return RecordingVerbs(self, staging_bytes, max_send_wr)

    def connected(self, local: Endpoint, remote: Endpoint):
        """The target that ``remote`` names, if it is a QP connected back to ``local`` with matching PSNs."""
        entry = self._qps.get((remote.gid, remote.qp_num))
        if entry is None:
            return None
        target_endpoint, peer, target = entry
        if peer.gid != local.gid or peer.qp_num != local.qp_num or peer.psn != local.psn:
            return None
        return target if target_endpoint.psn == remote.psn else None

    def add_qp(self, endpoint: Endpoint, peer: Endpoint, target: RecordingTarget) -> None:
        self._qps[(endpoint.gid, endpoint.qp_num)] = (endpoint, peer, target)

    def remove_qps(self, target: RecordingTarget) -> None:
        self._qps = {key: entry for key, entry in self._qps.items() if entry[2] is not target}


class RecordingTarget(VerbsTarget):
    """The engine's side: host segments registered under fake addresses and random rkeys; accepted QPs."""

    def __init__(self, fabric: RecordingFabric):
        self.fabric = fabric
        self.gid = fabric.new_gid()
        self._regions: dict[int, tuple[int, object]] = {}     # rkey -> (address, memory)

    def register(self, segment) -> RdmaRegion:
        if not isinstance(segment, HostSegment):
            raise ValueError("the recording verbs layer has no GPU memory: stand a LocalMemory in a HostSegment in "
                             "for the device segment")
        addr = (len(self._regions) + 1) * _REGION_SPACING
        rkey = self.fabric.random.getrandbits(32)
        while rkey in self._regions:
            rkey = self.fabric.random.getrandbits(32)
        self._regions[rkey] = (addr, segment.memory)
        return RdmaRegion(start=segment.start, size=segment.size, addr=addr, rkey=rkey)

    def accept(self, remote: Endpoint) -> Endpoint:
        endpoint = self.fabric.endpoint(self.gid)
        self.fabric.add_qp(endpoint, remote, self)
        return endpoint

    def access(self, rkey: int, addr: int, length: int):
        """``(memory, offset)`` that ``[addr, addr + length)`` under ``rkey`` names, or None (remote access error)."""
        if rkey not in self._regions:
            return None
        base, memory = self._regions[rkey]
        if not (base <= addr and addr + length <= base + memory.size):
            return None
        return memory, addr - base

    def close(self) -> None:
        self.fabric.remove_qps(self)
        self._regions.clear()


class RecordingVerbs(Verbs):
    """The agent's QP on a fake NIC. ``posted`` records every work request in posting order, ``executed`` each
    executed one with the bytes it moved."""

    def __init__(self, fabric: RecordingFabric, staging_bytes: int, max_send_wr: int):
        self.fabric = fabric
        self.staging = memoryview(bytearray(staging_bytes))
        self.max_send_wr = max_send_wr
        self.endpoint = fabric.endpoint(fabric.new_gid())
        self.remote: Endpoint | None = None
        self.posted: list[WorkRequest] = []
        self.executed: list[tuple[WorkRequest, bytes]] = []
        self.in_error = False
        self.stalled = False
        self._pending: deque[WorkRequest] = deque()
        self._send_queue: deque[int] = deque()      # wr_ids holding a send-queue entry, in posting order
        self._completions: deque[Completion] = deque()
        self._injected: list[int] | None = None     # [executions left before the failure, status]

    def connect(self, remote: Endpoint) -> None:
        self.remote = remote

    def post(self, request: WorkRequest) -> None:
        if self.remote is None:
            raise RdmaError("ibv_post_send on a QP in INIT: connect() it first")
        if len(self._send_queue) >= self.max_send_wr:
            raise RdmaError(f"ibv_post_send: the send queue's {self.max_send_wr} entries are all in use (ENOMEM)")
        self.posted.append(request)
        self._pending.append(request)
        self._send_queue.append(request.wr_id)

    def poll(self, max_entries: int) -> list[Completion]:
        self.progress()
        polled = []
        while self._completions and len(polled) < max_entries:
            completion = self._completions.popleft()
            while self._send_queue:
                if self._send_queue.popleft() == completion.wr_id:
                    break
            polled.append(completion)
        return polled

    def close(self) -> None:
        self._pending.clear()

    # -- the fake NIC -------------------------------------------------------------------------------------------

    def inject(self, status: int, after: int = 0) -> None:
        """Fail the request executed after ``after`` more successful ones with ``status``."""
        self._injected = [after, status]

    def stall(self, stalled: bool = True) -> None:
        self.stalled = stalled

    def break_qp(self) -> None:
        """The QP enters the error state (an asynchronous fatal event): later requests are flushed."""
        self.in_error = True

    def progress(self) -> None:
        """Execute every pending request in posting order (nothing while stalled)."""
        while self._pending and not self.stalled:
            request = self._pending.popleft()
            status = self._execute(request)
            if status != WC_SUCCESS:
                self.in_error = True
            if request.signaled or status != WC_SUCCESS:
                self._completions.append(Completion(request.wr_id, status))

    def _execute(self, request: WorkRequest) -> int:
        if self.in_error:
            return WC_WR_FLUSH_ERR
        if self._injected is not None:
            if self._injected[0] == 0:
                status, self._injected = self._injected[1], None
                return status
            self._injected[0] -= 1
        if request.local_offset + request.length > len(self.staging):
            return WC_LOC_PROT_ERR
        target = self.fabric.connected(self.endpoint, self.remote)
        if target is None:
            return WC_RETRY_EXC_ERR
        place = target.access(request.rkey, request.remote_addr, request.length)
        if place is None:
            return WC_REM_ACCESS_ERR
        memory, offset = place
        local = slice(request.local_offset, request.local_offset + request.length)
        if request.opcode == READ:
            self.staging[local] = memory.read(offset, request.length)
        else:
            memory.write(offset, self.staging[local])
        self.executed.append((request, bytes(self.staging[local])))
        return WC_SUCCESS
