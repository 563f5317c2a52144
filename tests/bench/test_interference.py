"""blink.bench.interference: hogs start and burn CPU, and are always gone afterwards — on a normal exit, on an
exception, and when the benchmark process itself is killed."""
import os
import signal
import subprocess
import sys
import time

import pytest

from blink.bench.interference import HOG_KINDS, interference


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def command_line(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie (dead, waiting for a parent that is not us to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_hogs_copy_memory_and_compress_while_the_block_runs_and_are_reaped_after():
    with interference(2) as hogs:
        # Each burns CPU: 0.3 s of it, however long a busy box takes to give it that (the memory hog imports numpy).
        wait_until(lambda: all(cpu_seconds(h.pid) > 0.3 for h in hogs), timeout_s=120)
        commands = [command_line(h.pid) for h in hogs]
    assert b"np.copyto" in commands[0] and b"zlib.compress" in commands[1]
    assert all(h.returncode is not None for h in hogs), "killed and waited for"
    assert all(gone(h.pid) for h in hogs)


@pytest.mark.parametrize("kind,program", [("memory", b"np.copyto"), ("cpu", b"zlib.compress")])
def test_hogs_of_one_kind_all_run_its_program(kind, program):
    with interference(3, HOG_KINDS[kind]) as hogs:
        # Until it has exec'd, a started hog's command line is still its parent's.
        wait_until(lambda: all(b"prctl" in command_line(h.pid) for h in hogs))
        commands = [command_line(h.pid) for h in hogs]
    assert all(program in command for command in commands), commands
    other = b"zlib.compress" if program == b"np.copyto" else b"np.copyto"
    assert not any(other in command for command in commands)


def test_hogs_are_reaped_when_the_block_raises():
    with pytest.raises(RuntimeError, match="benchmark failed"), interference(3) as hogs:
        raise RuntimeError("benchmark failed")
    assert len(hogs) == 3 and all(h.returncode is not None for h in hogs)


def test_hogs_die_with_a_killed_benchmark():
    code = ("import sys, time\nfrom blink.bench.interference import interference\n"
            "with interference(2) as hogs:\n"
            "    print(' '.join(str(h.pid) for h in hogs), flush=True)\n"
            "    time.sleep(60)\n")
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in bench.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        wait_until(lambda: all(gone(p) for p in pids))
    finally:
        bench.kill()
        bench.wait()


@pytest.mark.parametrize("parent_nice", [-10, 5])
def test_hogs_run_at_nice_0_under_a_raised_client_and_keep_a_lowered_one(parent_nice):
    """A benchmark that raised its own priority (--client-priority high) still gets neighbours at nice 0; one that
    runs below normal (``nice blink bench serve``) gets hogs at its nice, which is all an unprivileged hog may do."""
    code = ("import os, time\nfrom blink.bench.interference import interference\n"
            f"os.setpriority(os.PRIO_PROCESS, 0, {parent_nice})\n"
            "with interference(2) as hogs:\n"
            "    time.sleep(1.0)\n"
            "    print(' '.join(str(os.getpriority(os.PRIO_PROCESS, h.pid)) for h in hogs), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if parent_nice < 0 and "PermissionError" in done.stderr:
        pytest.skip("raising a priority needs CAP_SYS_NICE here")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(max(parent_nice, 0))] * 2


def test_hogs_are_pinned_round_robin_to_their_cores():
    cores = sorted(os.sched_getaffinity(0))
    with interference(len(cores) + 1) as every, interference(2, cpus=[cores[-1]]) as one:
        assert [os.sched_getaffinity(h.pid) for h in every] == [{c} for c in cores + cores[:1]]
        assert [os.sched_getaffinity(h.pid) for h in one] == [{cores[-1]}] * 2


def test_no_interference_and_bad_counts():
    with interference(0) as hogs:
        assert hogs == []
    with pytest.raises(ValueError, match="--interference must be >= 0"), interference(-1):
        pass
