import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest

from blink.ring.transport import LocalMemory, SharedMemory


def _shm_name():
    return f"blink-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", "shared"])
def memory(request):
    if request.param == "local":
        mem = LocalMemory(10000)
    else:
        mem = SharedMemory.create(_shm_name(), 10000)
    yield mem
    mem.close()


def test_fresh_region_is_zero_and_reads_back_writes(memory):
    assert memory.read(0, memory.size) == bytes(memory.size)
    payload = np.arange(100, dtype="<u4").tobytes()
    memory.write(1000, payload)
    memory.write(1400, b"\x01\x02\x03")
    memory.fence()
    assert memory.read(1000, 400) == payload
    assert memory.read(1399, 5) == payload[-1:] + b"\x01\x02\x03\x00"
    assert memory.read(memory.size - 1, 1) == b"\x00"


def test_read_returns_a_snapshot_not_a_live_view(memory):
    memory.write(0, b"abcd")
    snap = memory.read(0, 4)
    memory.write(0, b"wxyz")
    assert snap == b"abcd"


@pytest.mark.parametrize("offset,nbytes", [(-1, 1), (9999, 2), (10000, 1), (0, 10001)])
def test_out_of_range_access_is_refused(memory, offset, nbytes):
    with pytest.raises(ValueError, match="outside the 10000-byte region"):
        memory.read(offset, nbytes)
    with pytest.raises(ValueError, match="outside"):
        memory.write(offset, bytes(max(nbytes, 0)))


def _child_writes(name, offset, data):
    mem = SharedMemory.open(name)
    mem.write(offset, data)
    mem.close()


def test_another_process_sees_the_same_shared_region():
    name = _shm_name()
    with SharedMemory.create(name, 8192) as mem:
        proc = mp.get_context("spawn").Process(target=_child_writes, args=(name, 4096, b"from the child"))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
        assert mem.read(4096, 14) == b"from the child"
        assert os.path.exists(mem.path)  # an opener closing does not unlink
    assert not os.path.exists(os.path.join(SharedMemory.SHM_DIR, name)), "the creator unlinks on close"


def test_shared_memory_errors_name_the_problem():
    with pytest.raises(FileNotFoundError, match="no shared-memory ring named"):
        SharedMemory.open(_shm_name())
    name = _shm_name()
    with SharedMemory.create(name, 4096):
        with pytest.raises(FileExistsError):
            SharedMemory.create(name, 4096)
        with pytest.raises(ValueError, match="is 4096 bytes, expected 8192"):
            SharedMemory.open(name, 8192)
    for bad in ("", "a/b"):
        with pytest.raises(ValueError, match="name"):
            SharedMemory.create(bad, 4096)
    with pytest.raises(ValueError, match="size"):
        SharedMemory.create(_shm_name(), 0)
    with pytest.raises(ValueError, match="size"):
        LocalMemory(0)


def test_a_ring_larger_than_the_room_in_dev_shm_is_refused_before_it_is_created():
    stat = os.statvfs(SharedMemory.SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    name = _shm_name()
    with pytest.raises(ValueError, match=rf"the ring takes .* MiB but {SharedMemory.SHM_DIR} has .* MiB free"):
        SharedMemory.create(name, free + 2**30)
    assert not os.path.exists(os.path.join(SharedMemory.SHM_DIR, name))

