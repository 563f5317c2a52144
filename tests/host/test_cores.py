"""blink.host.cores: the agent's core is chosen among those the process may use (its cpuset), least busy first, never
one another blink server claims; claims die with their process; the choice is said in one line."""
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from blink.host.cores import Claims, Placement, busy_fractions, by_idleness, cpu_list, parse_cpu_list, place
from tests.privileges import run_as, shared_dir, unused_uid

STAT_BEFORE = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 400 0 0 0 0 0 0
cpu1 50 0 50 400 0 0 0 0 0 0
intr 1234
"""
# Over the window core 0 ran 90 of 100 ticks (10 idle), core 1 ran 10 and waited on I/O for 10 of the 90 others.
STAT_AFTER = """cpu  200 0 200 1600 0 0 0 0 0 0
cpu0 130 0 60 410 0 0 0 0 0 0
cpu1 55 0 55 480 10 0 0 0 0 0
intr 2345
"""
several_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores this process may use")


def test_core_lists_read_and_write_the_kernels_notation():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5] and parse_cpu_list("3") == [3]
    assert cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    for bad in ("", "a", "2-", "-1", "1,,2", "3-1"):
        with pytest.raises(ValueError, match="a core list is core numbers and ranges"):
            parse_cpu_list(bad)


def test_busy_time_comes_from_proc_stat_deltas_and_orders_the_cores():
    busy = busy_fractions(STAT_BEFORE, STAT_AFTER)
    assert busy == pytest.approx({0: 0.9, 1: 0.1})
    assert by_idleness([0, 1], busy) == [1, 0]
    assert by_idleness([0, 1, 2, 3], {0: 0.2, 1: 0.2, 2: 0.5}) == [1, 0, 2, 3], "ties go high; unknown is busy"


def test_a_core_is_claimed_by_one_process_at_a_time_and_freed_by_close(tmp_path):
    first, second = Claims(str(tmp_path)), Claims(str(tmp_path))
    assert first.claim(3) and first.claim(3), "claiming one's own core again"
    assert not second.claim(3) and second.holder(3) == os.getpid()
    assert first.holder(3) is None, "one's own claim is nobody else's"
    first.close()
    assert second.holder(3) is None and second.claim(3)
    second.close()


def test_the_claim_of_a_killed_process_is_gone_with_it(tmp_path):
    code = (f"from blink.host.cores import Claims; c = Claims({str(tmp_path)!r}); assert c.claim(5); "
            "print('claimed', flush=True); import time; time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "claimed\n"
        claims = Claims(str(tmp_path))
        assert claims.holder(5) == holder.pid and not claims.claim(5)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert claims.claim(5), "the kernel dropped the killed process's lock"
    finally:
        holder.kill()
        holder.wait()


def test_a_placement_keeps_the_agent_within_the_allowed_cores_and_off_the_engines():
    with pytest.raises(ValueError, match=r"the agent's cores \[4\] must be some of \[0, 1\]"):
        Placement((0, 1), (4,), (0,), "--cpus", {})
    with pytest.raises(ValueError, match="overlap"):
        Placement((0, 1), (1,), (0, 1), "--cpus", {})
    line = Placement((0, 1, 2, 3), (3,), (0, 1), "the least busy", {2: 77}).describe()
    assert line == ("agent on core 3 (the least busy), engine on cores 0-1; claimed by other blink servers: "
                    "core 2 (pid 77)")


@several_cores
def test_two_servers_pick_different_cores_and_say_which(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="blink")
    allowed = sorted(os.sched_getaffinity(0))
    with place(claim_dir=str(tmp_path), sample_s=0.1) as first, place(claim_dir=str(tmp_path),
                                                                      sample_s=0.1) as second:
        assert first.agent != second.agent and {*first.agent, *second.agent} <= set(allowed)
        assert not set(first.engine) & set(first.agent) and not set(second.engine) & set(second.agent)
        assert second.others == {first.agent[0]: os.getpid()}
        if len(allowed) > 2:
            assert not set(second.engine) & set(first.agent), "the engine keeps off the other server's agent"
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"agent on core {first.agent[0]} (the least busy unclaimed of cores "
                               f"{cpu_list(allowed)} this process may use, over 0.1 s: ")
    assert lines[1].endswith(f"; claimed by other blink servers: core {first.agent[0]} (pid {os.getpid()})")


def test_the_cpuset_is_honoured_and_one_core_is_shared(tmp_path):
    """In a process that may use one core (a cgroup cpuset or taskset), that core is the agent's and the engine is
    not pinned; --cpus outside the allowed set is refused in a sentence."""
    core = max(os.sched_getaffinity(0))
    code = (f"import logging, os; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
            f"os.sched_setaffinity(0, {{{core}}}); from blink.host.cores import place\n"
            f"with place(claim_dir={str(tmp_path)!r}) as p: print(p.agent, p.engine)\n"
            f"try:\n    with place([{core + 1}], claim_dir={str(tmp_path)!r}): pass\n"
            "except ValueError as e: print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"({core},) ()",
        f"--cpus {core + 1}: this process may only use cores {core} (its affinity: the cgroup's cpuset, taskset); "
        "pick cores among those"]
    assert done.stderr == f"agent on core {core} (the only core this process may use), engine beside it (not pinned)\n"


@several_cores
def test_requested_cores_are_used_even_where_another_server_claims_them(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="blink")
    core = max(os.sched_getaffinity(0))
    with place([core], claim_dir=str(tmp_path)) as first, place([core], claim_dir=str(tmp_path)) as second:
        assert first.agent == second.agent == (core,) and core not in second.engine
        assert second.others == {core: os.getpid()}
    assert caplog.records[0].getMessage().startswith(f"agent on core {core} (--cpus), engine on core")


def wait_until(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_standin() -> tuple[subprocess.Popen, list[str]]:
    """A ``blink serve --standin`` process and the list its stderr's lines go to, read to the end by a thread: a
    server must never block writing to a pipe the test stopped reading."""
    server = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(free_port()),
                               "--slots", "4", "--max-model-len", "256"], stderr=subprocess.PIPE, text=True)
    written: list[str] = []

    def read_all():
        for line in server.stderr:
            written.append(line)
    threading.Thread(target=read_all, daemon=True).start()
    return server, written


def logged(written: list[str], start: str) -> str:
    """The first line in ``written`` that starts with ``start``, once there is one."""
    wait_until(lambda: any(line.startswith(start) for line in written))
    return next(line for line in written if line.startswith(start))


@pytest.mark.serial
@several_cores
def test_two_blink_serve_on_one_host_pin_their_agents_to_different_cores():
    """End to end: the second server sees the first's claim in /dev/shm, and each agent runs where it said. Each is
    stopped by SIGINT once it serves: before, a SIGINT meets the disposition the server inherited, which a shell's
    background job (a CI run with ``&``) sets to ignore. A server that does not stop on it fails the test with its
    stderr, every thread's stack at the end (SIGUSR1)."""
    servers, lines = [], []
    try:
        for _ in range(2):
            servers.append(serve_standin())
            lines.append(logged(servers[-1][1], "blink: agent on core"))
            wait_until(lambda: os.sched_getaffinity(servers[-1][0].pid) == {int(lines[-1].split()[4])})
            logged(servers[-1][1], "blink: serving")
        cores = [int(line.split()[4]) for line in lines]
        assert f"claimed by other blink servers: core {cores[0]} (pid {servers[0][0].pid})" in lines[1]
        # Servers of other tests run beside this one (pytest -n without -m serial) may hold cores too.
        claims = {int(core): int(pid) for core, pid in re.findall(r"core (\d+) \(pid (\d+)\)", lines[1])}
        foreign = {core for core, pid in claims.items() if pid != servers[0][0].pid}
        if not os.sched_getaffinity(0) - foreign - {cores[0]}:
            pytest.skip(f"other blink servers held every core but the first's: {lines[1]}")
        assert cores[0] != cores[1], lines
    finally:
        for server, _ in servers:
            server.send_signal(signal.SIGINT)
        for server, written in servers:
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.send_signal(signal.SIGUSR1)      # blink.cli prints every thread's stack on it
                time.sleep(2)
                pytest.fail(f"blink serve (pid {server.pid}) did not stop within 30 s of its SIGINT; its stderr ends:\n"
                            + "".join(written[-80:]))
            finally:
                server.kill()       # one that ignored its SIGINT fails the test without holding its core claim on



@pytest.mark.parametrize("made_by", ["the other user", "root"])
def test_files_planted_by_another_user_never_make_a_root_server_write_elsewhere(made_by):
    """Issue 38 #1: another local user who makes the claim directory first, or plants links in root's (the kernel
    does not follow them only where fs.protected_symlinks / protected_hardlinks are set), must not get a root server
    to chmod or overwrite a file of root's, nor hang it on a FIFO."""
    with shared_dir() as directory:
        _plant_and_claim(directory, made_by)


def _plant_and_claim(directory, made_by: str) -> None:
    uid = unused_uid()
    victim = directory / "victim"
    victim.write_text("root's own\n")
    os.chmod(victim, 0o600)
    claims_dir = directory / "blink-cores"
    if made_by == "root":
        made = Claims(str(claims_dir))
        assert made.claim(7) and made.unavailable is None
        made.close()
    planted = run_as(uid, f"""
import os
os.makedirs({str(claims_dir)!r}, mode=0o777, exist_ok=True)
os.symlink({str(victim)!r}, {str(claims_dir / "0")!r})
os.mkfifo({str(claims_dir / "1")!r})
""")
    assert planted.returncode == 0, planted.stderr
    # What the other user links where fs.protected_hardlinks is 0 (this host's kernel may forbid it to link a file it
    # does not own, so root links it here).
    os.link(victim, claims_dir / "2")
    for core in (0, 1, 2):
        claims = Claims(str(claims_dir))
        assert claims.claim(core) and claims.holder(core) is None, "claims here are unavailable: nothing to respect"
        claims.close()
        assert victim.read_text() == "root's own\n", f"core {core}'s claim overwrote root's file"
        assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600, f"core {core}'s claim chmodded root's file"
        assert claims.unavailable is not None, f"core {core}'s planted file was used as a claim"
