"""Which host cores the agent and the engine run on: ``place`` picks the agent's core from those this process may use
(its affinity, which the kernel already narrows to the cgroup's cpuset and any ``taskset``), the least busy first,
skipping cores that another blink server on this host has claimed; the engine gets the rest.

A claim is an exclusive ``flock`` on ``CLAIM_DIR/<core>`` held for the server's life. The kernel drops it when the
process exits, however it exits (a killed server leaves no stale claim, and no pid is trusted); the files stay, empty
of meaning once unlocked (unlinking them would race with another server locking the same name). Claims are seen by
processes that share ``/dev/shm``: servers in separate containers are kept apart by their cpusets instead
(docs/serving.md, "Reserved cores").

The directory is shared by every user's servers, so nothing in it steers this process's writes elsewhere: the
directory must be a real one (never a link), owned by root or this process's user, and sticky where others may write
it; a claim file is never a link (``O_NOFOLLOW``), must be a regular file with one name, and is made here only with
``O_EXCL`` (only a file made here is chmodded). Anything else makes claims unavailable, said once.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("blink")
CLAIM_DIR = "/dev/shm/blink-cores"
MAX_CORES = 8192        # the largest CONFIG_NR_CPUS Linux builds with
SAMPLE_S = 0.2          # how long the cores' busy time is watched before the agent's is chosen
# A claim file is never followed as a link; non-blocking, so that a FIFO planted under its name cannot hang the open.
_CLAIM_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Placement:
    """``allowed``: the cores this process may use; ``agent``: the agent's cores; ``engine``: the engine process's
    cores (empty: the engine is not pinned, e.g. on one core); ``how``: how the agent's were chosen; ``others``:
    core -> pid (0 if unknown) of the other blink servers whose agents claim a core of ``allowed``.
    Invariants: ``agent`` is a non-empty subset of ``allowed``; ``engine`` is disjoint from ``agent``."""

    allowed: tuple[int, ...]
    agent: tuple[int, ...]
    engine: tuple[int, ...]
    how: str
    others: dict[int, int]

    def __post_init__(self):
        if not self.agent or not set(self.agent) <= set(self.allowed):
            raise ValueError(f"the agent's cores {list(self.agent)} must be some of {list(self.allowed)}")
        if set(self.engine) & set(self.agent):
            raise ValueError(f"the engine's cores {list(self.engine)} overlap the agent's {list(self.agent)}")

    def describe(self, with_engine: bool = True) -> str:
        """The line ``place`` logs, e.g. ``agent on core 15 (the least busy ...), engine on cores 0-14``."""
        line = f"agent on {_cores_word(self.agent)} ({self.how})"
        if with_engine:
            line += f", engine on {_cores_word(self.engine)}" if self.engine else ", engine beside it (not pinned)"
        if self.others:
            line += "; claimed by other blink servers: " + ", ".join(
                f"core {core} (pid {pid or '?'})" for core, pid in sorted(self.others.items()))
        return line


def parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the kernel's cpuset notation, as ``taskset -c`` takes it)."""
    cores = set()
    for part in text.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or dash and not last.isdigit() or dash and int(last) < int(first):
            raise ValueError(f"a core list is core numbers and ranges, e.g. 2,3 or 0-13,15 (got {text!r})")
        if int(last or first) >= MAX_CORES:     # a typo must not build a set of 10**9 cores
            raise ValueError(f"core numbers are below {MAX_CORES} (got {text!r})")
        cores.update(range(int(first), int(last or first) + 1))
    return sorted(cores)


def cpu_list(cores) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpuset notation)."""
    runs, cores = [], sorted(cores)
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _cores_word(cores) -> str:
    return f"{'core' if len(cores) == 1 else 'cores'} {cpu_list(cores)}"


def busy_fractions(before: str, after: str) -> dict[int, float]:
    """Per core, the share of the time between two reads of ``/proc/stat`` it was not idle (idle + iowait)."""
    def times(text):
        rows = (line.split() for line in text.splitlines() if line.startswith("cpu") and line[3:4].isdigit())
        return {int(row[0][3:]): [int(v) for v in row[1:]] for row in rows}

    start, end = times(before), times(after)
    busy = {}
    for core in start.keys() & end.keys():
        # user nice system idle iowait irq softirq steal; guest time is already counted in user
        delta = [b - a for a, b in zip(start[core][:8], end[core][:8], strict=True)]
        total = sum(delta)
        busy[core] = 1.0 - (delta[3] + delta[4]) / total if total else 0.0
    return busy


def sample_busy(window_s: float = SAMPLE_S) -> dict[int, float]:
    """``busy_fractions`` over the next ``window_s`` seconds (empty where there is no ``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            before = f.read()
        time.sleep(window_s)
        with open("/proc/stat") as f:
            return busy_fractions(before, f.read())
    except OSError:
        return {}


def by_idleness(cores, busy: dict[int, float]) -> list[int]:
    """``cores`` least busy first; a core ``busy`` does not know counts as fully busy. Ties go to the higher core:
    core 0 takes most interrupts and housekeeping work."""
    return sorted(cores, key=lambda core: (busy.get(core, 1.0), -core))


class Claims:
    """The cores this process claims for its agent (exclusive flocks under ``directory``), released on ``close``."""

    def __init__(self, directory: str = CLAIM_DIR):
        self.directory = directory
        self._held: dict[int, int] = {}         # core -> the open, locked claim file
        self.unavailable: str | None = None      # why claims cannot be made here, once found

    def claim(self, core: int) -> bool:
        """Claim ``core``: True if this process holds it now (or claims are unavailable here: nothing to respect)."""
        if core in self._held:
            return True
        fd = self._open(core)
        if fd is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._held[core] = fd
        return True

    def holder(self, core: int) -> int | None:
        """The pid (0 if unknown) of another process that claims ``core``, or None if none does."""
        if core in self._held:
            return None
        fd = self._open(core)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)     # a probe: held for an instant, then dropped
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        finally:
            os.close(fd)
        return None

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)                        # closing the only descriptor drops the lock
        self._held.clear()

    def _open(self, core: int) -> int | None:
        """The claim file of ``core``, opened; None (said once) if this host's claim directory cannot be used."""
        if self.unavailable is not None:
            return None
        try:
            directory = _open_claim_directory(self.directory)
            try:
                return _open_claim_file(directory, str(core))
            finally:
                os.close(directory)
        except OSError as e:
            self.unavailable = f"{self.directory}: {e.strerror or errno.errorcode.get(e.errno, e)}"
            log.warning("cannot claim cores in %s; another blink server on this host may pick the same core",
                        self.unavailable)
            return None


def _open_claim_directory(path: str) -> int:
    """``path`` opened as a directory (made, mode 1777, if absent), once it is safe to open files in: ``OSError``
    saying why it is not."""
    try:
        os.mkdir(path, 0o700)
        made = True
    except FileExistsError:
        made = False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if made:
            os.fchmod(fd, 0o1777)       # every user's servers claim here; sticky, as /tmp
        info = os.fstat(fd)
        if info.st_uid not in (0, os.geteuid()):
            raise OSError(errno.EPERM, f"it belongs to uid {info.st_uid}, who could swap the files in it: remove it "
                                       "(the next server makes it again), or make it as root: mkdir -m 1777")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise OSError(errno.EPERM, f"others may write it (mode {stat.S_IMODE(info.st_mode):o}) and it is not "
                                       "sticky: chmod 1777 it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_claim_file(directory: int, name: str) -> int:
    """The claim file ``name`` in the open ``directory``, opened read-write: an existing one if it is a regular file
    with no other name (a link to another file, planted by another user, is refused, never written), else a new one
    made here (mode 0666: another user's server may lock it)."""
    try:
        fd = os.open(name, _CLAIM_OPEN, dir_fd=directory)
    except FileNotFoundError:
        try:
            fd = os.open(name, _CLAIM_OPEN | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=directory)
        except FileExistsError:         # another server made it meanwhile
            return _open_claim_file(directory, name)
        os.fchmod(fd, 0o666)            # whatever the umask
        return fd
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EPERM, f"claim file {name} is not a regular file with one name (another user may have "
                                   "planted it): remove it")
    return fd


@contextmanager
def place(requested: list[int] | None = None, *, with_engine: bool = True, claim_dir: str = CLAIM_DIR,
          sample_s: float = SAMPLE_S, count: int = 1):
    """Choose and claim the agent's cores (``requested``, e.g. ``--cpus``, or the ``count`` least busy allowed cores
    no other blink server claims, one per agent process, leaving at least one to the engine); yields the
    ``Placement``, logged in one line, and releases the claim on exit.

    ``ValueError`` if ``requested`` names a core this process may not use. On one allowed core the agent and the
    engine share it. Where every allowed core is claimed, the least busy is shared, and the line says with whom.
    """
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    if requested and not set(requested) <= set(allowed):
        raise ValueError(f"--cpus {cpu_list(requested)}: this process may only use cores {cpu_list(allowed)} (its "
                         "affinity: the cgroup's cpuset, taskset); pick cores among those")
    claims = Claims(claim_dir)
    try:
        if requested:
            agent, how = tuple(sorted(set(requested))), "--cpus"
            for core in agent:
                claims.claim(core)      # asked for by name: shared with another server if it must be
        elif len(allowed) == 1:
            agent, how = allowed, "the only core this process may use"
        else:
            agent, how = _least_busy(allowed, claims, sample_s, max(1, min(count, len(allowed) - with_engine)))
        others = {core: pid for core in allowed if (pid := claims.holder(core)) is not None}
        rest = [core for core in allowed if core not in agent]
        engine = () if not with_engine or len(allowed) == 1 else tuple(
            [core for core in rest if core not in others] or rest)
        placement = Placement(allowed, agent, engine, how, others)
        log.info("%s", placement.describe(with_engine))
        yield placement
    finally:
        claims.close()


def _least_busy(allowed: tuple[int, ...], claims: Claims, sample_s: float, count: int) -> tuple[tuple[int], str]:
    busy = sample_busy(sample_s)
    order = by_idleness(allowed, busy)
    share = f"of cores {cpu_list(allowed)} this process may use, over {sample_s:.1f} s"
    taken = []
    for core in order:
        if len(taken) < count and claims.claim(core):
            taken.append(core)
    if taken:
        how = ", ".join(f"{busy.get(core, 1.0):.0%}" for core in taken)
        return tuple(sorted(taken)), f"the least busy unclaimed {share}: {how} busy"
    return (order[0],), f"every core is claimed by another blink server: sharing the least busy {share}"
