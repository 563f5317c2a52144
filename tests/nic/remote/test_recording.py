"""The recording fake of the RDMA hardware behaves like the RC service the transport relies on."""
import pytest

from blink.errors import RdmaError
from blink.nic.remote.recording import RecordingFabric
from blink.nic.remote.segments import HostSegment
from blink.nic.remote.verbs import (READ, WC_LOC_PROT_ERR, WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR, WC_SUCCESS,
                                    WC_WR_FLUSH_ERR, WRITE, Completion, WorkRequest)
from blink.ring.transport import LocalMemory


@pytest.fixture
def pair():
    fabric = RecordingFabric()
    target = fabric.target()
    memory = LocalMemory(8192)
    region = target.register(HostSegment(0, memory))
    verbs = fabric.initiator(4096, 4)
    verbs.connect(target.accept(verbs.endpoint))
    yield verbs, region, memory, target, fabric
    memory.close()


def wr(wr_id, region, *, opcode=WRITE, local=0, length=4, offset=0, signaled=True, rkey=None):
    return WorkRequest(wr_id, opcode, local, length, region.addr + offset, region.rkey if rkey is None else rkey,
                       signaled)


def test_requests_do_nothing_until_the_nic_runs_then_apply_in_order(pair):
    verbs, region, memory, *_ = pair
    verbs.staging[0:4] = b"AAAA"
    verbs.staging[4:8] = b"BBBB"
    verbs.post(wr(0, region, local=0, offset=100, signaled=False))
    verbs.post(wr(1, region, local=4, offset=100))
    assert memory.read(100, 4) == bytes(4), "nothing is visible before the NIC executes"
    verbs.staging[4:8] = b"CCCC"            # the NIC reads staging when it executes, not when posted
    assert verbs.poll(8) == [Completion(1, WC_SUCCESS)], "only the signaled request completes"
    assert memory.read(100, 4) == b"CCCC"
    assert [request.wr_id for request, _ in verbs.executed] == [0, 1]


def test_reads_land_in_staging(pair):
    verbs, region, memory, *_ = pair
    memory.write(200, b"ring")
    verbs.post(wr(0, region, opcode=READ, local=16, offset=200))
    verbs.poll(1)
    assert bytes(verbs.staging[16:20]) == b"ring"


def test_a_full_send_queue_refuses_until_a_completion_is_polled(pair):
    verbs, region, *_ = pair
    for k in range(4):
        verbs.post(wr(k, region, signaled=k == 1))
    with pytest.raises(RdmaError, match="send queue's 4 entries are all in use"):
        verbs.post(wr(4, region))
    verbs.poll(8)                   # polls the completion of wr 1: entries 0 and 1 are free again, 2 and 3 are not
    verbs.post(wr(4, region))
    verbs.post(wr(5, region))
    with pytest.raises(RdmaError, match="all in use"):
        verbs.post(wr(6, region))


@pytest.mark.parametrize("request_of,status", [
    (lambda region: wr(0, region, rkey=region.rkey ^ 1), WC_REM_ACCESS_ERR),
    (lambda region: wr(0, region, offset=8192 - 2), WC_REM_ACCESS_ERR),
    (lambda region: WorkRequest(0, WRITE, 0, 4, region.addr - 4, region.rkey, True), WC_REM_ACCESS_ERR),
    (lambda region: wr(0, region, local=4094), WC_LOC_PROT_ERR),
])
def test_bad_accesses_fail_with_the_status_hardware_gives(pair, request_of, status):
    verbs, region, *_ = pair
    verbs.post(request_of(region))
    verbs.post(wr(1, region, signaled=False))
    assert verbs.poll(8) == [Completion(0, status), Completion(1, WC_WR_FLUSH_ERR)], "then the QP is in error"


def test_an_unsignaled_failure_still_completes(pair):
    verbs, region, *_ = pair
    verbs.inject(WC_RETRY_EXC_ERR, after=1)
    for k in range(3):
        verbs.post(wr(k, region, signaled=False))
    assert verbs.poll(8) == [Completion(1, WC_RETRY_EXC_ERR), Completion(2, WC_WR_FLUSH_ERR)]


def test_a_qp_that_does_not_reach_a_target_connected_back_retries_out(pair):
    verbs, region, memory, target, fabric = pair
    stranger = fabric.initiator(4096, 4)
    stranger.connect(target.accept(verbs.endpoint))     # a target QP connected to someone else
    stranger.post(wr(0, region))
    assert stranger.poll(1) == [Completion(0, WC_RETRY_EXC_ERR)]
    target.close()                                      # the engine went away
    verbs.post(wr(0, region))
    assert verbs.poll(1) == [Completion(0, WC_RETRY_EXC_ERR)]


def test_a_stalled_nic_completes_nothing_and_posting_needs_a_connection(pair):
    verbs, region, *_ = pair
    verbs.stall()
    verbs.post(wr(0, region))
    assert verbs.poll(8) == []
    verbs.stall(False)
    assert verbs.poll(8) == [Completion(0, WC_SUCCESS)]
    loose = RecordingFabric().initiator(64, 2)
    with pytest.raises(RdmaError, match="QP in INIT"):
        loose.post(wr(0, region))


def test_the_target_refuses_device_memory():
    from blink.nic.remote.segments import DeviceSegment

    segment = DeviceSegment(0, 4096, 0x7F0000000000, bytes(64), "0000:1b:00.0")
    with pytest.raises(ValueError, match="no GPU memory"):
        RecordingFabric().target().register(segment)
