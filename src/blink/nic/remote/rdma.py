"""``RdmaMemory``: the ring reached over one RDMA RC queue pair, with exactly the ``RemoteMemory`` guarantees.

Every access is a work request on ONE queue pair (``verbs.Verbs``): ``write`` posts RDMA WRITEs, ``read`` posts RDMA
READs and waits for them, ``fence`` waits until every earlier write has reached the ring's memory. The ring's bytes
may sit in several registered regions (``wire.RdmaRegion``: GPU memory through dma-buf, host memory through a plain
MR); ring offsets are translated to (remote address, rkey) here, and an access that crosses a region's end is split.

Ordering, which the agent's protocol rests on ("payload first, state word last"):

- in order: RC executes the work requests of one send queue in posting order, so a state word written after its
  payload lands after it. The engine's memory must be registered without relaxed ordering (the NIC's PCIe writes
  then reach the GPU in order, and an H200 reports ``GPU_DIRECT_RDMA_WRITES_ORDERING = OWNER``: the owning GPU
  consumes them in order);
- fence: a signaled RDMA READ of the ring's first word. RC executes a READ after every earlier WRITE of the QP and
  PCIe reads do not pass earlier posted writes, so its completion means those writes are in the ring's memory (a
  WRITE's own completion only says the responder received it). Nothing is posted when every write has completed.

Selective signalling with a bounded send queue: the send queue holds ``depth = send_queue_depth`` requests and
every ``depth // 2``-th request (``wr_id % (depth // 2) == depth // 2 - 1``) is signaled, as is every READ. A
request's completion retires it and every earlier one, so whenever the queue is full it holds two signaled
requests, and waiting for a completion frees entries. The staging buffer has one ``cell_bytes`` cell per queue
entry (request ``wr_id`` uses cell ``wr_id % depth``), so a cell is reused only after its request retired: a
WRITE's source bytes stay untouched until the NIC has sent them, a READ's are copied out when it completes.

Not thread-safe: one agent (one thread) per ``RdmaMemory``. After any failure it raises ``RdmaError`` for every
call: an RC QP in the error state cannot be repaired, the agent reconnects.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass

from blink.errors import RdmaError
from blink.nic.remote.verbs import READ, WC_SUCCESS, WRITE, Verbs, WorkRequest, describe_status
from blink.nic.remote.regions import RdmaRegion
from blink.ring.transport import RemoteMemory

FENCE_BYTES = 4     # the fence reads the control block's magic word, which nobody writes after creation


@dataclass(frozen=True)
class RdmaConfig:
    """How the RDMA transport uses its queue pair.

    ``send_queue_depth``: work requests the send queue holds (``max_send_wr``), even; every ``depth // 2``-th is
    signaled. ``cell_bytes``: staging bytes per send-queue entry, the most one work request moves; longer accesses
    become several requests. ``completion_timeout_s``: how long a wait for a completion may take before the
    connection is declared dead (the QP's own retries give up after ~0.5 s at ``timeout=14, retry_cnt=7``).
    """

    send_queue_depth: int = 64
    cell_bytes: int = 64 * 1024
    completion_timeout_s: float = 5.0

    def __post_init__(self):
        d, c, t = self.send_queue_depth, self.cell_bytes, self.completion_timeout_s
        if not isinstance(d, int) or isinstance(d, bool) or not 2 <= d <= 1 << 15 or d % 2:
            raise ValueError(f"RdmaConfig.send_queue_depth must be an even int in [2, {1 << 15}] (got {d!r})")
        if not isinstance(c, int) or isinstance(c, bool) or not 64 <= c <= 1 << 30 or c % 64:
            raise ValueError(f"RdmaConfig.cell_bytes must be a multiple of 64 in [64, {1 << 30}] (got {c!r})")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (t > 0 and math.isfinite(t)):
            raise ValueError(f"RdmaConfig.completion_timeout_s must be a positive number of seconds (got {t!r})")

    @property
    def signal_interval(self) -> int:
        return self.send_queue_depth // 2

    @property
    def staging_bytes(self) -> int:
        return self.send_queue_depth * self.cell_bytes


class RdmaMemory(RemoteMemory):
    """``size`` ring bytes in the engine's ``regions``, reached through ``verbs`` (a QP already in RTS whose send
    queue depth and staging buffer fit ``config``)."""

    def __init__(self, verbs: Verbs, regions: tuple[RdmaRegion, ...], size: int, config: RdmaConfig = RdmaConfig()):
        if verbs.max_send_wr < config.send_queue_depth or len(verbs.staging) < config.staging_bytes:
            raise ValueError(f"the verbs layer has a {verbs.max_send_wr}-entry send queue and {len(verbs.staging)} "
                             f"staging bytes; RdmaConfig needs {config.send_queue_depth} and {config.staging_bytes}")
        end = 0
        for region in regions:
            if region.start != end:
                raise ValueError(f"RDMA region at ring offset {region.start} should start at {end}: the regions "
                                 "must tile the ring in order")
            end = region.start + region.size
        if end != size:
            raise ValueError(f"the RDMA regions cover [0, {end}) but the ring is {size} bytes")
        self.verbs, self.config, self.size = verbs, config, size
        self.regions = tuple(regions)
        self._starts = [region.start for region in self.regions]
        self._next = 0              # wr_id of the next request = its position in the send queue's sequence
        self._retired = 0           # every request with a smaller wr_id has completed
        self._last_write = -1       # wr_id of the latest WRITE
        self._outstanding: deque = deque()  # (wr_id, opcode, ring offset, length) not yet retired
        self._reads: deque = deque()        # (wr_id, cell offset, destination) to copy out once retired
        self._failure: RdmaError | None = None
        self._closed = False

    # -- RemoteMemory -----------------------------------------------------------------------------------------

    def write(self, offset: int, data) -> None:
        """Post RDMA WRITEs of ``data`` (copied to staging first); returns without waiting for them."""
        self._check_usable()
        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        for piece, length, addr, rkey in self._pieces(offset, len(data)):
            source = data[piece - offset:piece - offset + length]
            self._post(WRITE, piece, length, addr, rkey, source=source)

    def read(self, offset: int, nbytes: int) -> bytes:
        """Post RDMA READs of ``[offset, offset + nbytes)`` and wait for them."""
        self._check_usable()
        self._check_range(offset, nbytes)
        result = bytearray(nbytes)
        view = memoryview(result)
        last = None
        for piece, length, addr, rkey in self._pieces(offset, nbytes):
            last = self._post(READ, piece, length, addr, rkey, destination=view[piece - offset:piece - offset + length])
        if last is not None:
            self._wait_until(lambda: self._retired > last, f"the RDMA READ of ring bytes [{offset}, {offset + nbytes})")
        return bytes(result)

    def fence(self) -> None:
        """Return once every earlier write is in the ring's memory (see the module docstring)."""
        self._check_usable()
        if self._last_write < self._retired:
            return
        first = self.regions[0]
        fence = self._post(READ, 0, FENCE_BYTES, first.addr, first.rkey)
        self._wait_until(lambda: self._retired > fence, "the fence's RDMA READ")

    def close(self) -> None:
        """Fence (the last writes land before the QP goes away), then release the verbs layer."""
        if self._closed:
            return
        try:
            if self._failure is None:
                self.fence()
        finally:
            self._closed = True
            self.verbs.close()

    # -- posting and completions ----------------------------------------------------------------------------------

    def _pieces(self, offset: int, nbytes: int):
        """``(ring offset, length, remote address, rkey)`` for each work request of an access: split where a
        region ends and every ``cell_bytes``."""
        end = offset + nbytes
        k = bisect.bisect_right(self._starts, offset) - 1
        while offset < end:
            region = self.regions[k]
            region_end = region.start + region.size
            if offset >= region_end:
                k += 1
                continue
            length = min(end, region_end, offset + self.config.cell_bytes) - offset
            yield offset, length, region.addr + (offset - region.start), region.rkey
            offset += length

    def _post(self, opcode: str, offset: int, length: int, addr: int, rkey: int, *, source=None,
              destination=None) -> int:
        """Post one request in the next send-queue entry and its staging cell; return its wr_id."""
        self._wait_until(lambda: self._next - self._retired < self.config.send_queue_depth,
                         "a free send-queue entry")
        wr_id = self._next
        cell = (wr_id % self.config.send_queue_depth) * self.config.cell_bytes
        if source is not None:
            self.verbs.staging[cell:cell + length] = source
        interval = self.config.signal_interval
        signaled = opcode == READ or wr_id % interval == interval - 1
        try:
            self.verbs.post(WorkRequest(wr_id, opcode, cell, length, addr, rkey, signaled))
        except RdmaError as e:
            self._fail(RdmaError(f"posting the {opcode} of {length} bytes at ring offset {offset} failed: {e}"))
        self._next += 1
        self._outstanding.append((wr_id, opcode, offset, length))
        if destination is not None:
            self._reads.append((wr_id, cell, destination))
        if opcode == WRITE:
            self._last_write = wr_id
        return wr_id

    def _wait_until(self, condition, what: str) -> None:
        """Poll completions until ``condition()`` holds; busy-polls, as the agent's loop does (RDMA round trips are
        microseconds). ``RdmaError`` after ``completion_timeout_s`` without it."""
        if condition():
            return
        deadline = time.monotonic() + self.config.completion_timeout_s
        while True:
            self._poll()
            if condition():
                return
            if time.monotonic() > deadline:
                self._fail(RdmaError(
                    f"no completion for {what} within {self.config.completion_timeout_s} s with "
                    f"{self._next - self._retired} work requests in flight: the NIC or the link stalled; check the "
                    "link (ibv_devinfo: port state) and the engine, then reconnect"))

    def _poll(self) -> None:
        for completion in self.verbs.poll(self.config.send_queue_depth):
            if not self._retired <= completion.wr_id < self._next:
                self._fail(RdmaError(f"completion for wr_id {completion.wr_id}, which is not in flight "
                                     f"([{self._retired}, {self._next})): another user shares this QP's CQ?"))
            if completion.status != WC_SUCCESS:
                vendor = f" (vendor error {completion.vendor_err:#x})" if completion.vendor_err else ""
                self._fail(RdmaError(f"{self._describe(completion.wr_id)} failed: "
                                     f"{describe_status(completion.status)}{vendor}"))
            self._retired = completion.wr_id + 1
        while self._reads and self._reads[0][0] < self._retired:
            _, cell, destination = self._reads.popleft()
            destination[:] = self.verbs.staging[cell:cell + len(destination)]
        while self._outstanding and self._outstanding[0][0] < self._retired:
            self._outstanding.popleft()

    def _describe(self, wr_id: int) -> str:
        for known, opcode, offset, length in self._outstanding:
            if known == wr_id:
                return f"the {opcode} of {length} bytes at ring offset {offset}"
        return f"work request {wr_id}"

    def _fail(self, error: RdmaError):
        self._failure = error
        raise error

    def _check_usable(self) -> None:
        if self._closed:
            raise RdmaError("this RDMA connection to the ring is closed")
        if self._failure is not None:
            raise RdmaError(f"this RDMA connection to the ring failed earlier and cannot be used: {self._failure}")
