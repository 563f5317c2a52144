"""CPU priority for the host's processes on a host shared with noisy neighbours: ``set_priority`` raises the agent
(the only host process on the per-token path) or a benchmark client as far as this process is permitted;
``reset_priority`` puts the engine process (it only sleeps while the GPU schedules itself) back to the normal class.

Not done, as measured on the H200 (docs/benchmarks/interference.md, "Tried and not kept"): asking Linux 6.12+ for
a short EEVDF slice (sched_setattr's sched_runtime, 0.1 ms) for the agent and the client, meant to let their wake-ups
preempt a running neighbour, made every tail worse beside 64 hogs (P50 TTFT 8.2x isolated instead of 1.8x).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import resource
import struct

from blink.host.cores import cpu_list

log = logging.getLogger("blink")

# "auto": nice -10, or the best below it this process is allowed. Not realtime: on a CPU box with hogs on every core
# it held the target no better than nice -10 (docs/benchmarks/interference.md, "Agent immunity"), and a real-time
# agent that ever spun would starve its core's normal tasks (the kernel's softirq threads among them) down to 5%.
PRIORITIES = ("auto", "normal", "high", "realtime", "deadline")
HIGH_NICE = -10
RT_PRIORITY = 10
# "deadline": SCHED_DEADLINE with this budget per period. The agent sleeps between polls (1 ms by default);
# with its budget left it runs the moment it wakes, ahead of every normal task, and a spinning or overloaded agent
# is held to half a core. With GRUB reclaiming (SCHED_FLAG_RECLAIM) it may also use bandwidth no other deadline task
# holds, so a burst (many prompts at once) is slowed only where the host's real-time share is spent.
DEADLINE_RUNTIME_NS = 500_000
DEADLINE_PERIOD_NS = 1_000_000
_ADVICE = ("it needs CAP_SYS_NICE (root) or a raised RLIMIT_NICE / RLIMIT_RTPRIO (ulimit -e / -r; systemd "
           "LimitNICE= / LimitRTPRIO=)")
_ADVICE_CLASS = {
    "realtime": "; in a container or cgroup without a real-time budget (cpu.rt_runtime_us) SCHED_RR is refused even to "
                "root",
    "deadline": "; SCHED_DEADLINE is also refused to a process whose cores (cpuset, taskset) do not span the host's "
                "scheduling domain"}


def set_priority(level: str, option: str = "--agent-priority") -> str:
    """Raise the calling thread's CPU priority for a host shared with noisy neighbours: the agent's (the only host
    process on the per-token path; the engine process only sleeps) or a benchmark client's; returns what it
    achieved, e.g. ``"high (nice -10)"``. ``high``: nice -10, so where busy processes at nice 0 share a core this one
    gets ~10x their CPU share and its wake-ups preempt them. ``realtime``: SCHED_RR 10, so it runs whenever it is
    runnable; it sleeps between polls, and Linux keeps 5% of every core for normal tasks. ``deadline``:
    SCHED_DEADLINE, ``DEADLINE_RUNTIME_NS`` of every ``DEADLINE_PERIOD_NS``, so each wake-up preempts a running
    neighbour (never waits out its slice) and even a spinning agent leaves half its core; the kernel refuses the
    class to a thread held to some of the host's cores, so the caller must not pin it (``is_deadline``), and the
    threads it starts begin in the normal class (reset on fork; ``helper_priority`` gives them nice -10).
    ``auto``: high if this process may take it, else the best below.

    Invariant: a refused level never raises and never leaves the process half-raised: it carries on at the best level
    below it that is permitted (after nice -10, the lowest nice RLIMIT_NICE allows) and says so in one log line, a
    warning when ``level`` was asked for by name. Threads started afterwards inherit the result (``serve`` starts
    the engine before the agent calls this, and the engine resets its own: ``reset_priority``). ``option`` names the
    command-line option in the message."""
    if level not in PRIORITIES:
        raise ValueError(f"{option} must be one of {', '.join(PRIORITIES)} (got {level!r})")
    refused = []
    for raise_to in _LADDERS[level]:
        try:
            achieved = raise_to()
        except PermissionError as e:
            refused.append(f"{e.filename} ({e.strerror})")
            continue
        if achieved is None:
            continue
        if level == "auto":
            log.info("%s auto: %s%s", option, achieved, f" ({', '.join(refused)} not permitted)" if refused else "")
        elif refused:
            log.warning("%s %s: %s not permitted; running at %s. To raise it: %s%s", option, level,
                        ", ".join(refused), achieved, _ADVICE, _ADVICE_CLASS.get(level, ""))
        return achieved
    raise AssertionError("unreachable: the normal level is always permitted")


def _deadline() -> str | None:
    """SCHED_DEADLINE for the calling thread; None where this machine has no known sched_setattr."""
    global _helper_nice
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return None
    attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, SCHED_DEADLINE, _RESET_ON_FORK | _RECLAIM, 0, 0, DEADLINE_RUNTIME_NS,
                            DEADLINE_PERIOD_NS, DEADLINE_PERIOD_NS)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[0], 0, ctypes.create_string_buffer(attr, len(attr)), 0) != 0:
        err = ctypes.get_errno()
        raise PermissionError(err, os.strerror(err), "SCHED_DEADLINE")
    _helper_nice = HIGH_NICE        # permitted: the class needed CAP_SYS_NICE
    return (f"deadline (SCHED_DEADLINE {DEADLINE_RUNTIME_NS / 1e6:g} ms every {DEADLINE_PERIOD_NS / 1e6:g} ms, "
            "not pinned)")


def is_deadline() -> bool:
    """Whether the calling thread runs in SCHED_DEADLINE (then it may not be pinned to a subset of the host's
    cores: ``sched_setaffinity`` fails)."""
    return os.sched_getscheduler(0) & ~_RESET_ON_FORK_POLICY == SCHED_DEADLINE


def pin(cores, named: bool) -> None:
    """Pins the calling thread (and the threads it starts) to ``cores``, unless it runs in the deadline class, which
    runs where it wakes (the kernel refuses it a subset of the host's cores); then cores ``named`` by the user get a
    warning saying they only keep the engine off."""
    if not is_deadline():
        os.sched_setaffinity(0, cores)
    elif named:
        log.warning("--agent-priority deadline runs the agent unpinned: --cpus %s only keeps the engine off them",
                    cpu_list(cores))


def helper_priority() -> None:
    """For threads the agent starts (``ThreadPoolExecutor(initializer=...)``): the nice its own thread had before a
    deadline class, which reset on fork does not pass on. A no-op otherwise (threads inherit a nice level)."""
    if _helper_nice is not None and os.getpriority(os.PRIO_PROCESS, 0) > _helper_nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, _helper_nice)
        except PermissionError:
            pass


def _realtime() -> str:
    _refusal_named(f"SCHED_RR {RT_PRIORITY}", os.sched_setscheduler, 0, os.SCHED_RR, os.sched_param(RT_PRIORITY))
    return f"realtime (SCHED_RR {RT_PRIORITY})"


def _high() -> str:
    _refusal_named(f"nice {HIGH_NICE}", os.setpriority, os.PRIO_PROCESS, 0, HIGH_NICE)
    return f"high (nice {HIGH_NICE})"


def _rlimit_nice() -> str | None:
    """The lowest nice above -10 that RLIMIT_NICE lets an unprivileged thread take (20 - the limit), or None."""
    floor = 20 - resource.getrlimit(resource.RLIMIT_NICE)[0]
    if not HIGH_NICE < floor < os.getpriority(os.PRIO_PROCESS, 0):
        return None
    os.setpriority(os.PRIO_PROCESS, 0, floor)
    return f"nice {floor} (RLIMIT_NICE)"


def _normal() -> str:
    return "normal"


def _refusal_named(what: str, call, *args) -> None:
    """``call(*args)``; a ``PermissionError`` it raises names ``what`` was refused (its ``filename``)."""
    try:
        call(*args)
    except PermissionError as e:
        raise PermissionError(e.errno, e.strerror, what) from None


# Each level's ladder, from what it asks for down to what is always permitted.
_LADDERS = {"deadline": (_deadline, _high, _rlimit_nice, _normal),
            "realtime": (_realtime, _high, _rlimit_nice, _normal),
            "high": (_high, _rlimit_nice, _normal), "auto": (_high, _rlimit_nice, _normal), "normal": (_normal,)}


def reset_priority() -> None:
    """Put the calling thread in the normal class at nice >= 0: the engine's entry calls it, so an engine never keeps
    a real-time class or a negative nice it inherited (from a raised agent, or a ``blink serve`` started under
    ``chrt`` / ``nice -n -5``). It only sleeps while the GPU schedules itself; a real-time engine that ever spun
    would starve its core. Lowering one's own priority is always permitted."""
    if os.sched_getscheduler(0) & ~_RESET_ON_FORK_POLICY in (os.SCHED_FIFO, os.SCHED_RR, SCHED_DEADLINE):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if os.getpriority(os.PRIO_PROCESS, 0) < 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)



# sched_setattr(2): the syscall numbers (set, get), and struct sched_attr's first version (48 bytes): size, policy,
# flags, nice, priority, runtime, deadline, period. Python's os module has no SCHED_DEADLINE.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")
SCHED_DEADLINE = 6
_RESET_ON_FORK, _RECLAIM = 0x01, 0x02          # sched_attr.sched_flags
_RESET_ON_FORK_POLICY = 0x40000000             # the same flag as sched_getscheduler reports it, or'ed into the policy
_helper_nice = None                            # set by _deadline: the nice for the agent's helper threads
