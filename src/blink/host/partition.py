"""A core of the host given to the agent alone: a cgroup v2 cpuset partition (``--reserve-agent-cores``).

A child of the cgroup v2 root whose ``cpuset.cpus.partition`` is ``root`` takes its cores out of the root's
effective set, so no other process on the host — the engine, the neighbours, whatever cgroup they sit in — may run
on them, while the process moved into it may run nowhere else: the reserved layout of the immunity benchmarks
(docs/benchmarks/interference.md, "Agent immunity on the H200"), enforced by the kernel and made by the server itself
for the core ``blink.host.cores.place`` chose.

It needs root (or a delegated root cgroup) and cgroup v2 mounted at ``/sys/fs/cgroup`` with the cpuset controller;
inside a container's cgroup namespace the kernel refuses a partition (its root is not a partition root). Refused,
the server runs without it and says why. The partition lives as long as the block: on exit the process goes back to
its cgroup and the partition is removed, which gives the cores back. A server killed with SIGKILL leaves an empty
partition holding its cores; the next server with this option removes it (or: ``rmdir /sys/fs/cgroup/blink-agent-*``).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from blink.host.cores import cpu_list

log = logging.getLogger("blink")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "blink-agent-"


class PartitionRefused(Exception):
    """The host would not make the partition; the message says what was refused and what to do."""


@contextmanager
def reserved_cores(cores, pid: int | None = None, root: Path = CGROUP_ROOT):
    """Moves process ``pid`` (default: this one, all its threads) into a new partition of exactly ``cores``; yields
    the partition's directory, or None where the host refuses (logged as a warning with the reason). Invariant: on
    exit the process is back in the cgroup it came from and the partition is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        origin, partition, added_cpuset = _create(Path(root), tuple(cores), pid)
    except PartitionRefused as e:
        log.warning("--reserve-agent-cores: %s; the agent's cores %s stay shared with the host", e,
                    cpu_list(cores))
        yield None
        return
    log.info("agent on its own cpuset partition %s (cores %s, no other process may use them)", partition,
             cpu_list(cores))
    try:
        yield partition
    finally:
        _remove(partition, origin, pid, Path(root), added_cpuset)


def _create(root: Path, cores: tuple[int, ...], pid: int) -> tuple[Path, Path, bool]:
    """(the process's former cgroup, the partition, whether the cpuset controller was enabled here)."""
    if not (root / "cgroup.controllers").exists():
        raise PartitionRefused(f"no cgroup v2 hierarchy at {root} (this host mounts cgroup v1 or none); reserve the "
                               "cores by hand instead (docs/serving.md, \"Reserved cores\")")
    origin = root / _cgroup_of(pid).lstrip("/")
    _remove_stale(root)
    added_cpuset = "cpuset" not in _read(root / "cgroup.subtree_control").split()
    if added_cpuset:
        _write(root / "cgroup.subtree_control", "+cpuset")
    partition = root / f"{PREFIX}{pid}"
    try:
        partition.mkdir()
    except OSError as e:
        _undo_cpuset(root, added_cpuset)
        raise PartitionRefused(f"cannot create {partition}: {e.strerror} (run as root)") from None
    try:
        _write(partition / "cpuset.cpus", cpu_list(cores))
        _write(partition / "cpuset.cpus.partition", "root")
        state = _read(partition / "cpuset.cpus.partition")
        if state != "root":         # e.g. "root invalid (Parent is not a partition root)" in a cgroup namespace
            raise PartitionRefused(f"the kernel made {partition} {state!r}, not a partition root")
        _write(partition / "cgroup.procs", str(pid))
    except PartitionRefused:
        _rmdir(partition)
        _undo_cpuset(root, added_cpuset)
        raise
    return origin, partition, added_cpuset


def _remove(partition: Path, origin: Path, pid: int, root: Path, added_cpuset: bool) -> None:
    try:
        _write(origin / "cgroup.procs", str(pid))
    except PartitionRefused as e:                # the process has exited: the partition is empty anyway
        log.debug("%s", e)
    _rmdir(partition)
    _undo_cpuset(root, added_cpuset)


def _remove_stale(root: Path) -> None:
    """Gives back the cores of the partitions ``stale_partitions`` finds."""
    for stale in stale_partitions(root):
        log.info("removing %s, the empty partition of a blink server that is gone", stale)
        _rmdir(stale)


def stale_partitions(root: Path) -> list[Path]:
    """Partitions of servers that were killed: named for a process that no longer exists, and empty (nothing runs on
    their cores). A live server's partition is never one, even in the moment between its creation and the server
    moving in, when it is empty too."""
    stale = []
    for partition in root.glob(f"{PREFIX}*"):
        pid = partition.name[len(PREFIX):]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        try:
            empty = not _read(partition / "cgroup.procs")
        except PartitionRefused:        # another server removed it meanwhile
            continue
        if empty:
            stale.append(partition)
    return stale


def _cgroup_of(pid: int) -> str:
    """The process's cgroup v2 path (the ``0::`` line of /proc/PID/cgroup)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise PartitionRefused(f"process {pid} is in no cgroup v2 hierarchy (/proc/{pid}/cgroup has no 0:: line)")


def _undo_cpuset(root: Path, added: bool) -> None:
    if added:   # only what this server enabled; refused while another cgroup uses it, which is then right
        try:
            _write(root / "cgroup.subtree_control", "-cpuset")
        except PartitionRefused as e:
            log.debug("%s", e)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError as e:
        log.warning("could not remove %s (%s): its cores stay reserved until it is removed", path, e.strerror)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        raise PartitionRefused(f"cannot read {path}: {e.strerror}") from None


def _write(path: Path, value: str) -> None:
    """One write of ``value`` to a cgroup file: the kernel answers each write alone (EINVAL, EBUSY, EACCES)."""
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise PartitionRefused(f"writing {value!r} to {path} was refused: {e.strerror}") from None
