import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest

from blink.nic.agent import Agent
from blink.ring.errors import RingRefused
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.shares import Share
from blink.ring.transport import LocalMemory, SharedMemory
from tests.privileges import run_as, second_user_reason, unused_uid


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



def test_a_rings_pages_are_reserved_at_creation():
    """Issue 38 #8: a sparse ring would take its pages at first write, and a /dev/shm filled meanwhile kills the
    writer with SIGBUS; a reserved one has every page from the start."""
    with SharedMemory.create(_shm_name(), 4 << 20) as memory:
        assert os.stat(memory.path).st_blocks * 512 >= memory.size


FILL_THEN_WRITE = """
import mmap, os, sys
from blink.ring.transport import SharedMemory
SharedMemory.SHM_DIR = sys.argv[1]
ring = SharedMemory.create("blink-full", 2 << 20)
with open(os.path.join(sys.argv[1], "filler"), "wb") as filler:   # another tenant fills /dev/shm
    try:
        while True:
            filler.write(bytes(1 << 16)); filler.flush()
    except OSError:
        pass
for offset in range(0, ring.size, mmap.PAGESIZE):
    ring.write(offset, b"x")
print("every page written")
"""


def test_a_full_dev_shm_after_creation_cannot_kill_the_rings_writer(tmp_path):
    """Issue 38 #8, as it happened: a small tmpfs (the container's /dev/shm) filled after the ring was made; every
    page of the ring is still written (a sparse ring died with SIGBUS, exit 135), in a private mount namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare, to mount a small tmpfs in a private mount namespace")
    mount = f"mount -t tmpfs -o size=4m blink-test {tmp_path}"
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'{mount} && exec "$0" -c "$1" {tmp_path}', sys.executable, FILL_THEN_WRITE],
                         capture_output=True, text=True, timeout=120)
    if "mount" in run.stderr and run.returncode not in (0, -signal.SIGBUS, 128 + signal.SIGBUS):
        pytest.skip(f"this host refuses a tmpfs mount in a mount namespace: {run.stderr.strip()}")
    assert run.returncode == 0 and "every page written" in run.stdout, (run.returncode, run.stderr[-2000:])


def _fake_ring_as(uid: int, name: str, mode: int) -> None:
    """What another local user's fake engine does: a file under the engine's ring name, with a valid control block."""
    layout = RingLayout(RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=8))
    made = run_as(uid, f"""
import os
fd = os.open({os.path.join(SharedMemory.SHM_DIR, name)!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, {mode})
os.fchmod(fd, {mode})
os.ftruncate(fd, {layout.size})
os.write(fd, bytes.fromhex({layout.control_bytes().hex()!r}))
""")
    assert made.returncode == 0, made.stderr


@pytest.mark.parametrize("mode", [0o666, 0o600], ids=["0666", "0600"])
def test_an_agent_never_attaches_to_a_ring_another_user_made(mode):
    """Issue 38 #2: another local user's fake engine under the name an agent is given (``blink agent --ring NAME``)
    would read every prompt and write the answers; the agent refuses a ring that is not its own user's."""
    if reason := second_user_reason():
        pytest.skip(reason)
    name = _shm_name()
    _fake_ring_as(unused_uid(), name, mode)
    try:
        with pytest.raises(RingRefused, match="belongs to uid .* not to this process's user"):
            SharedMemory.open(name)
    finally:
        os.unlink(os.path.join(SharedMemory.SHM_DIR, name))


def test_an_agent_never_attaches_to_a_ring_open_to_others_or_to_a_link(tmp_path):
    name = _shm_name()
    with SharedMemory.create(name, 4096) as ring:
        os.chmod(ring.path, 0o644)
        with pytest.raises(RingRefused, match="open to other users .*0644"):
            SharedMemory.open(name)
        link = _shm_name()
        os.symlink(ring.path, os.path.join(SharedMemory.SHM_DIR, link))
        try:
            with pytest.raises(RingRefused, match="symbolic link"):
                SharedMemory.open(link)
        finally:
            os.unlink(os.path.join(SharedMemory.SHM_DIR, link))


HOLD_AGENT = """
import sys, time
from blink.nic.agent import Agent
from blink.ring.transport import SharedMemory
agent = Agent.attach(SharedMemory.open(sys.argv[1]))
print("attached", flush=True)
time.sleep(60)
"""


def test_one_agent_per_ring():
    """Issue 38 #9: a second agent on a ring took the first's slots (its loop crashed; the second answered wrong);
    it is refused while the first is attached, in this process or another, and welcome once the first is gone."""
    layout = RingLayout(RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=8))
    name = _shm_name()
    with SharedMemory.create(name, layout.size) as ring:
        layout.initialise(ring)
        first = SharedMemory.open(name)
        Agent.attach(first)
        with SharedMemory.open(name) as second, pytest.raises(RingRefused, match="agent is attached"):
            Agent.attach(second)
        first.close()
        holder = subprocess.Popen([sys.executable, "-c", HOLD_AGENT, name], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline() == "attached\n"
            with SharedMemory.open(name) as second, pytest.raises(RingRefused, match="agent is attached"):
                Agent.attach(second)
        finally:
            holder.kill()
            holder.wait()
        with SharedMemory.open(name) as second:
            assert Agent.attach(second).in_flight == 0, "the killed agent's claim went with it"


def test_one_agent_per_slot():
    """Agents of one ring's disjoint shares attach side by side; one whose slots overlap a live agent's is refused,
    whatever the split (a lone agent over them all included), and welcome once that agent is gone."""
    layout = RingLayout(RingGeometry(n_slots=5, max_prompt_tokens=8, max_output_tokens=8))
    name = _shm_name()
    with SharedMemory.create(name, layout.size) as ring:
        layout.initialise(ring)
        first, second = SharedMemory.open(name), SharedMemory.open(name)
        Agent.attach(first, Share(0, 2))
        Agent.attach(second, Share(1, 2))
        for share, slots in [(Share(), "0-4"), (Share(1, 2), "2-4"), (Share(2, 3), "3-4"), (Share(0, 5), "0")]:
            with SharedMemory.open(name) as third, pytest.raises(RingRefused, match=f"agent is attached to slots? "
                                                                                      f"{slots} of the ring"):
                Agent.attach(third, share)
        second.close()
        with SharedMemory.open(name) as third:
            assert Agent.attach(third, Share(1, 2, restarts=1)).slots == range(2, 5)
        first.close()


def stores_of_one_write(nbytes: int, tmp_path) -> int:
    """How many times one ``LocalMemory.write`` of ``nbytes`` at an aligned offset touches its first word (gdb)."""
    script = os.path.join(os.path.dirname(__file__), "word_stores.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), BLINK_WORD_FILE=str(tmp_path / "address"))
    out = subprocess.run(["gdb", "-nx", "-batch", "-x", script, "--args", sys.executable, script, str(nbytes)],
                         capture_output=True, text=True, env=env, timeout=120).stdout
    if "stores: " not in out:
        pytest.skip(f"gdb could not watch the word (no hardware watchpoints or no ptrace here): {out[-300:]}")
    return int(out.split("stores: ")[1].split()[0])


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb to count the stores of a write")
@pytest.mark.parametrize("nbytes", [4, 8])
def test_a_word_write_is_one_store(nbytes, tmp_path):
    """Regression: a status word was written with memcpy, which stores 4 bytes twice; a consumer admitting the slot
    between the two stores (READY -> RUNNING) had its RUNNING overwritten by the second READY, and the reference
    consumer stopped with "slot N is RUNNING on the GPU side but the ring shows READY" (once in a CI run of the
    10,000-request agent test)."""
    assert stores_of_one_write(nbytes, tmp_path) == 1
