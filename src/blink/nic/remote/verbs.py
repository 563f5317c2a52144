"""The few verbs the RDMA transport needs, as an interface with two implementations: ``ibverbs`` (rdma-core through
pyverbs, on a real device) and ``recording`` (a fake of the hardware that records posted work requests and applies
them to memory, for machines without a device).

An initiator (``Verbs``, the agent's side) is one RC queue pair, its completion queue and one registered local
staging buffer. A work request moves ``length`` bytes between ``staging[local_offset:]`` and ``remote_addr`` under
``rkey``. What the transport relies on, all of it the RC service of the InfiniBand/RoCE specification:

- the send queue executes work requests in the order they were posted and completes them in that order, so a
  signaled request's completion retires it and every earlier one (selective signalling);
- a request that fails produces an error completion even when it was posted unsignaled, and moves the QP to the
  error state: every later request completes with ``IBV_WC_WR_FLUSH_ERR``;
- an RDMA READ is executed at the responder after every earlier RDMA WRITE of the same QP.

A target (``VerbsTarget``, the engine's side) registers the ring's memory for remote access and accepts one QP per
agent at setup; afterwards the NIC answers the agent's requests by itself, so the engine's CPU does nothing per
request.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from blink.nic.remote.regions import Endpoint, RdmaRegion

# Work request opcodes (ibverbs' IBV_WR_RDMA_WRITE / IBV_WR_RDMA_READ; each implementation maps them).
WRITE, READ = "RDMA WRITE", "RDMA READ"

# Work completion status codes: the values of libibverbs' ``enum ibv_wc_status`` (a stable ABI), so the pyverbs
# implementation passes ``wc.status`` through unchanged.
WC_SUCCESS = 0
WC_LOC_LEN_ERR = 1
WC_LOC_QP_OP_ERR = 2
WC_LOC_PROT_ERR = 4
WC_WR_FLUSH_ERR = 5
WC_REM_INV_REQ_ERR = 9
WC_REM_ACCESS_ERR = 10
WC_REM_OP_ERR = 11
WC_RETRY_EXC_ERR = 12
WC_FATAL_ERR = 19
WC_GENERAL_ERR = 21

# name, and what it means for the ring transport
WC_STATUS = {
    WC_SUCCESS: ("IBV_WC_SUCCESS", "done"),
    WC_LOC_LEN_ERR: ("IBV_WC_LOC_LEN_ERR", "the local length was refused (a transport bug: report it)"),
    WC_LOC_QP_OP_ERR: ("IBV_WC_LOC_QP_OP_ERR", "the local QP refused the request (a transport bug: report it)"),
    WC_LOC_PROT_ERR: ("IBV_WC_LOC_PROT_ERR",
                      "the local staging buffer refused the access (a transport bug: report it)"),
    WC_WR_FLUSH_ERR: ("IBV_WC_WR_FLUSH_ERR", "flushed: the queue pair was already in the error state"),
    WC_REM_INV_REQ_ERR: ("IBV_WC_REM_INV_REQ_ERR",
                         "the engine's QP refused the request (more RDMA READs in flight than it accepts?)"),
    WC_REM_ACCESS_ERR: ("IBV_WC_REM_ACCESS_ERR",
                        "the engine's NIC refused the rkey or address: the ring is no longer registered there (the "
                        "engine restarted?) or the offer did not describe it; reconnect"),
    WC_REM_OP_ERR: ("IBV_WC_REM_OP_ERR", "the engine's NIC could not complete the request; reconnect"),
    WC_RETRY_EXC_ERR: ("IBV_WC_RETRY_EXC_ERR",
                       "the engine's QP did not answer: it is gone (engine stopped), the QP number, GID or PSN of "
                       "the handshake do not reach it, or the link is down; check the link and reconnect"),
    WC_FATAL_ERR: ("IBV_WC_FATAL_ERR", "the local device failed; check the NIC (dmesg)"),
    WC_GENERAL_ERR: ("IBV_WC_GENERAL_ERR", "the device reported a general error; check the NIC (dmesg)"),
}


def describe_status(status: int) -> str:
    """``IBV_WC_REM_ACCESS_ERR (10): the engine's NIC refused ...``; unknown codes by number."""
    name, meaning = WC_STATUS.get(status, (f"ibv_wc_status {status}", "an unknown completion status"))
    return f"{name} ({status}): {meaning}"


@dataclass(frozen=True)
class WorkRequest:
    """One RDMA WRITE (staging -> remote) or READ (remote -> staging). ``wr_id`` is the transport's sequence
    number of the request on its send queue."""

    wr_id: int
    opcode: str
    local_offset: int
    length: int
    remote_addr: int
    rkey: int
    signaled: bool

    def __post_init__(self):
        if self.opcode not in (WRITE, READ):
            raise ValueError(f"WorkRequest.opcode must be {WRITE!r} or {READ!r} (got {self.opcode!r})")
        if self.length < 1 or self.local_offset < 0:
            raise ValueError(f"WorkRequest needs length >= 1 and local_offset >= 0 (got {self.length}, "
                             f"{self.local_offset})")


@dataclass(frozen=True)
class Completion:
    """A work completion: ``status`` is an ``ibv_wc_status`` code (``WC_SUCCESS`` when it went through)."""

    wr_id: int
    status: int
    vendor_err: int = 0


class Verbs(ABC):
    """The initiator side: one RC queue pair (created in INIT), its CQ and a registered staging buffer.

    ``staging`` is the writable buffer that every work request's local range lies in; ``max_send_wr`` the send
    queue's depth (posting more requests than that without retiring any is refused); ``endpoint`` the QP's address,
    sent to the engine in the handshake.
    """

    staging: memoryview
    max_send_wr: int
    endpoint: Endpoint

    @abstractmethod
    def connect(self, remote: Endpoint) -> None:
        """Bring the QP to RTS, connected to the engine's QP ``remote``."""

    @abstractmethod
    def post(self, request: WorkRequest) -> None:
        """Post one work request on the send queue (``RdmaError`` if the device refuses it)."""

    @abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """The completions available now, at most ``max_entries``, oldest first; never blocks."""

    def close(self) -> None:
        """Destroy the QP, CQ and registration."""


class VerbsTarget(ABC):
    """The engine side: the ring's segments registered for remote read and write, and one QP per agent."""

    @abstractmethod
    def register(self, segment) -> RdmaRegion:
        """Register one ``segments.HostSegment`` or ``segments.DeviceSegment``; its address and rkey for agents."""

    @abstractmethod
    def accept(self, remote: Endpoint) -> Endpoint:
        """A new QP connected to the agent's QP ``remote`` (RTR, then RTS); its endpoint for the agent."""

    def close(self) -> None:
        """Destroy every QP and deregister the ring: agents' later requests fail."""
