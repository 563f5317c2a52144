"""``reserved_cores``: a cgroup v2 cpuset partition that gives a process cores no other process may use. Where the
host refuses (no cgroup v2, no root, a cgroup namespace) it says why and changes nothing; where it permits (root on a
cgroup v2 host), the kernel itself is checked: the process runs only on the partition's cores, every other process
has lost them, and all of it is undone at exit."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blink.host.partition import CGROUP_ROOT, PREFIX, reserved_cores, stale_partitions
from tests.privileges import run_python


def test_a_host_without_cgroup_v2_is_refused_with_the_reason_and_nothing_changes(tmp_path, caplog):
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, "blink"), reserved_cores([min(before)], root=tmp_path) as partition:
        assert partition is None and os.sched_getaffinity(0) == before
    assert caplog.messages == [f"--reserve-agent-cores: no cgroup v2 hierarchy at {tmp_path} (this host mounts cgroup "
                               "v1 or none); reserve the cores by hand instead (docs/serving.md, \"Reserved cores\"); "
                               f"the agent's cores {min(before)} stay shared with the host"]
    assert list(tmp_path.iterdir()) == []


def test_split_cores_does_not_reserve_the_only_core_a_process_may_use():
    core = min(os.sched_getaffinity(0))
    done = run_python("import logging, os; logging.basicConfig(format='blink: %(message)s'); "
                      f"os.sched_setaffinity(0, {{{core}}}); from blink.host.process import split_cores\n"
                      "with split_cores(None, None, reserve=True) as cores:\n"
                      "    print(cores, sorted(os.sched_getaffinity(0)))")
    assert done.returncode == 0 and done.stdout == f"[{core}] [{core}]\n", done.stderr
    assert done.stderr == ("blink: --reserve-agent-cores: the agent's cores are all this process may use; not "
                           "reserved\n")


def test_only_the_empty_partitions_of_processes_that_are_gone_are_stale(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    def partition(name: str, procs: str = "") -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text(procs)
        return tmp_path / name
    gone = partition(f"{PREFIX}{ended.pid}")
    partition(f"{PREFIX}{os.getpid()}")                      # this live server's, not yet moved into: not stale
    partition(f"{PREFIX}999999999", procs="12345\n")         # not empty: something runs there
    partition(f"{PREFIX}custom")                             # not named for a process: not ours to remove
    partition("other-0")
    assert stale_partitions(tmp_path) == [gone]


def cgroup_of(pid: int) -> str:
    return next(line[3:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if line.startswith("0::"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core to keep and one to reserve")
def test_the_partition_is_the_processes_alone_and_is_undone_at_exit(caplog):
    """A stale partition (empty, as a killed server leaves it) is removed first. Skipped where the host refuses."""
    core = max(os.sched_getaffinity(0))
    stale = CGROUP_ROOT / f"{PREFIX}0"
    try:
        stale.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup at {CGROUP_ROOT}: {e.strerror}")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    origin = cgroup_of(sleeper.pid)
    try:
        with caplog.at_level(logging.INFO, "blink"), reserved_cores([core], pid=sleeper.pid) as partition:
            if partition is None:
                pytest.skip(caplog.messages[-1])
            assert not stale.exists()
            assert os.sched_getaffinity(sleeper.pid) == {core}
            assert core not in os.sched_getaffinity(0)          # taken from every other process on the host
            assert cgroup_of(sleeper.pid) == f"/{PREFIX}{sleeper.pid}"
            assert (partition / "cpuset.cpus.partition").read_text().strip() == "root"
        assert cgroup_of(sleeper.pid) == origin and not partition.exists()
        assert core in os.sched_getaffinity(0)
    finally:
        sleeper.kill()
        if stale.exists():
            stale.rmdir()
