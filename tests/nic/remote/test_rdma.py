"""RdmaMemory over the recording verbs layer: the RemoteMemory guarantees as posted work requests, the region
bookkeeping, selective signalling on a bounded send queue, the fence, and every error path."""
import numpy as np
import pytest

from blink.errors import RdmaError
from blink.nic.remote.rdma import FENCE_BYTES, RdmaConfig, RdmaMemory
from blink.nic.remote.recording import RecordingFabric
from blink.nic.remote.segments import HostSegment
from blink.nic.remote.verbs import READ, WC_REM_OP_ERR, WC_RETRY_EXC_ERR, WRITE
from blink.nic.remote.wire import RdmaRegion
from blink.ring.transport import LocalMemory

SMALL = RdmaConfig(send_queue_depth=4, cell_bytes=64, completion_timeout_s=0.2)


def connect(segments, config=SMALL, fabric=None):
    """An RdmaMemory on a recording QP connected to a target that registered ``segments``."""
    fabric = fabric or RecordingFabric()
    target = fabric.target()
    regions = tuple(target.register(segment) for segment in segments)
    verbs = fabric.initiator(config.staging_bytes, config.send_queue_depth)
    verbs.connect(target.accept(verbs.endpoint))
    size = segments[-1].start + segments[-1].size
    return RdmaMemory(verbs, regions, size, config), verbs, regions


@pytest.fixture
def split():
    """Ring bytes [0, 4096) and [4096, 12288) in two registered host memories."""
    low, high = LocalMemory(4096), LocalMemory(8192)
    memory, verbs, regions = connect([HostSegment(0, low), HostSegment(4096, high)])
    yield memory, verbs, regions, low, high
    low.close()
    high.close()


def test_it_is_a_remote_memory_with_read_back_snapshots_and_range_checks(split):
    memory, verbs, _, low, high = split
    payload = np.arange(300, dtype="<u4").tobytes()
    memory.write(3000, payload)
    assert memory.read(3000, len(payload)) == payload
    assert low.read(3000, 1096) == payload[:1096] and high.read(0, 104) == payload[1096:]
    snapshot = memory.read(3000, 4)
    memory.write(3000, b"wxyz")
    assert snapshot == payload[:4] and memory.read(3000, 4) == b"wxyz"
    for offset, nbytes in [(-1, 1), (12287, 2), (12288, 1)]:
        with pytest.raises(ValueError, match="outside the 12288-byte region"):
            memory.read(offset, nbytes)
        with pytest.raises(ValueError, match="outside"):
            memory.write(offset, bytes(max(nbytes, 0)))


def test_accesses_split_at_region_ends_and_cells_and_map_to_each_regions_address_and_rkey(split):
    memory, verbs, (low_region, high_region), *_ = split
    memory.write(4000, bytes(range(200)))
    pieces = [(r.opcode, r.remote_addr, r.rkey, r.length) for r in verbs.posted]
    assert pieces == [(WRITE, low_region.addr + 4000, low_region.rkey, 64),
                      (WRITE, low_region.addr + 4064, low_region.rkey, 32),      # the low region ends at 4096
                      (WRITE, high_region.addr + 0, high_region.rkey, 64),
                      (WRITE, high_region.addr + 64, high_region.rkey, 40)]
    assert [r.local_offset for r in verbs.posted] == [0, 64, 128, 192], "request k uses staging cell k % depth"


def test_every_half_queue_th_request_and_every_read_is_signaled(split):
    memory, verbs, *_ = split
    for k in range(10):
        memory.write(8 * k, b"12345678")
    memory.read(0, 80)
    writes = [r for r in verbs.posted if r.opcode == WRITE]
    assert [r.signaled for r in writes] == [k % 2 == 1 for k in range(10)]
    assert all(r.signaled for r in verbs.posted if r.opcode == READ)


def test_a_long_stream_through_a_tiny_queue_never_reuses_a_cell_too_early():
    ring = LocalMemory(8192)
    memory, verbs, _ = connect([HostSegment(0, ring)], RdmaConfig(send_queue_depth=2, cell_bytes=64))
    expected = bytearray(8192)
    for k in range(500):
        data = bytes([k % 251]) * (1 + k % 150)
        offset = (37 * k) % (8192 - len(data))
        memory.write(offset, data)
        expected[offset:offset + len(data)] = data
    memory.fence()
    assert ring.read(0, 8192) == bytes(expected), "the fake reads staging when it executes: early reuse shows"
    assert len(verbs.posted) > 500


def test_writes_are_invisible_until_fence_which_posts_one_signaled_read_of_the_first_word(split):
    memory, verbs, (low_region, _), low, _ = split
    memory.write(100, b"data")
    assert low.read(100, 4) == bytes(4), "posted, but the NIC has not run yet"
    memory.fence()
    assert low.read(100, 4) == b"data"
    fence = verbs.posted[-1]
    assert (fence.opcode, fence.remote_addr, fence.length, fence.signaled) == (READ, low_region.addr, FENCE_BYTES,
                                                                               True)
    memory.fence()
    memory.read(0, 4)
    memory.fence()
    assert len(verbs.posted) == 3, "nothing to fence once every write has completed"


def test_read_waits_for_the_writes_before_it(split):
    memory, verbs, *_ = split
    memory.write(5000, b"abc")
    assert memory.read(4999, 5) == b"\0abc\0"
    assert len(verbs.posted) == 2


def misregistered(size: int, rkey_flip: int = 0) -> RdmaMemory:
    """An RdmaMemory over a 4096-byte registered ring that claims ``size`` bytes under the rkey xor ``rkey_flip``."""
    fabric = RecordingFabric()
    target = fabric.target()
    good = target.register(HostSegment(0, LocalMemory(4096)))
    verbs = fabric.initiator(SMALL.staging_bytes, SMALL.send_queue_depth)
    verbs.connect(target.accept(verbs.endpoint))
    return RdmaMemory(verbs, (RdmaRegion(0, size, good.addr, good.rkey ^ rkey_flip),), size, SMALL)


def test_a_bad_rkey_fails_at_the_next_wait_naming_the_request_and_the_status():
    memory = misregistered(4096, rkey_flip=0xFF)
    memory.write(512, b"x" * 10)
    with pytest.raises(RdmaError, match=r"RDMA WRITE of 10 bytes at ring offset 512 failed: IBV_WC_REM_ACCESS_ERR"
                                         r" \(10\): the engine's NIC refused the rkey"):
        memory.fence()
    with pytest.raises(RdmaError, match="failed earlier and cannot be used: the RDMA WRITE of 10 bytes"):
        memory.write(0, b"y")


def test_an_out_of_range_region_is_a_remote_access_error():
    memory = misregistered(8192)
    with pytest.raises(RdmaError, match="RDMA READ of 4 bytes at ring offset 6000 failed: IBV_WC_REM_ACCESS_ERR"):
        memory.read(6000, 4)


def test_an_unsignaled_write_that_fails_surfaces_at_the_next_read(split):
    memory, verbs, *_ = split
    verbs.inject(WC_RETRY_EXC_ERR, after=0)
    memory.write(64, b"lost")                   # wr 0: unsignaled
    memory.write(68, b"gone")                   # wr 1: flushed
    with pytest.raises(RdmaError, match="RDMA WRITE of 4 bytes at ring offset 64 failed: IBV_WC_RETRY_EXC_ERR.*"
                                        "did not answer"):
        memory.read(0, 4)


@pytest.mark.parametrize("fault,message", [
    (lambda verbs: verbs.break_qp(), "IBV_WC_WR_FLUSH_ERR.*already in the error state"),      # a QP in error flushes
    (lambda verbs: verbs.inject(WC_REM_OP_ERR), r"IBV_WC_REM_OP_ERR \(11\)"),              # any status is named
    (lambda verbs: verbs.stall(), r"no completion for the RDMA READ of ring bytes \[0, 4\) within 0.2 s"),
], ids=["qp-in-error", "any-status", "stalled-nic-times-out"])
def test_a_failing_nic_is_an_rdma_error_naming_what_failed(split, fault, message):
    memory, verbs, *_ = split
    fault(verbs)
    with pytest.raises(RdmaError, match=message):
        memory.read(0, 4)


def test_a_refused_post_is_an_rdma_error():
    fabric = RecordingFabric()
    ring = LocalMemory(4096)
    region = fabric.target().register(HostSegment(0, ring))
    verbs = fabric.initiator(SMALL.staging_bytes, SMALL.send_queue_depth)       # never connected
    memory = RdmaMemory(verbs, (region,), 4096, SMALL)
    with pytest.raises(RdmaError, match="posting the RDMA WRITE of 1 bytes at ring offset 0 failed: .*QP in INIT"):
        memory.write(0, b"x")


def test_close_fences_then_refuses(split):
    memory, verbs, _, low, _ = split
    memory.write(8, b"last")
    memory.close()
    assert low.read(8, 4) == b"last"
    with pytest.raises(RdmaError, match="closed"):
        memory.read(0, 4)
    memory.close()


def test_the_verbs_layer_and_the_regions_must_fit():
    fabric = RecordingFabric()
    with pytest.raises(ValueError, match="needs 4 and 256"):
        RdmaMemory(fabric.initiator(128, 4), (RdmaRegion(0, 4096, 0, 1),), 4096, SMALL)
    verbs = fabric.initiator(SMALL.staging_bytes, SMALL.send_queue_depth)
    with pytest.raises(ValueError, match="should start at 4096"):
        RdmaMemory(verbs, (RdmaRegion(0, 4096, 0, 1), RdmaRegion(8192, 4096, 0, 1)), 12288, SMALL)
    with pytest.raises(ValueError, match="cover \\[0, 4096\\) but the ring is 8192"):
        RdmaMemory(verbs, (RdmaRegion(0, 4096, 0, 1),), 8192, SMALL)


@pytest.mark.parametrize("field,value", [("send_queue_depth", 3), ("send_queue_depth", 0), ("send_queue_depth", True),
                                         ("cell_bytes", 100), ("cell_bytes", 0), ("completion_timeout_s", 0),
                                         ("completion_timeout_s", float("inf"))])
def test_rdma_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"RdmaConfig.{field}"):
        RdmaConfig(**{field: value})
