"""CPU priority for the host's processes on a host shared with noisy neighbours: ``set_priority`` raises the agent
(the only host process on the per-token path) or a benchmark client as far as this process is permitted;
``reset_priority`` puts the engine process (it only sleeps while the GPU schedules itself) back to the normal class.

Not done, as measured on the H200 (docs/benchmarks.md, "Agent immunity on the H200"): asking Linux 6.12+ for a short
EEVDF slice (sched_setattr's sched_runtime, 0.1 ms) for the agent and the client, meant to let their wake-ups preempt
a running neighbour, made every tail worse beside 64 hogs (P50 TTFT 8.2x isolated instead of 1.8x).
"""
from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("blink")

# "auto": nice -10, or the best below it this process is allowed. Not realtime: on a CPU box with hogs on every core
# it held the target no better than nice -10 (docs/benchmarks.md, "Agent immunity"), and a real-time agent that ever
# spun would starve its core's normal tasks (the kernel's softirq threads among them) down to 5%.
PRIORITIES = ("auto", "normal", "high", "realtime")
HIGH_NICE = -10
RT_PRIORITY = 10
_ADVICE = ("it needs CAP_SYS_NICE (root) or a raised RLIMIT_NICE / RLIMIT_RTPRIO (ulimit -e / -r; systemd "
           "LimitNICE= / LimitRTPRIO=)")
_ADVICE_RT = ("; in a container or cgroup without a real-time budget (cpu.rt_runtime_us) SCHED_RR is refused even to "
              "root")


def set_priority(level: str, option: str = "--agent-priority") -> str:
    """Raise the calling thread's CPU priority for a host shared with noisy neighbours: the agent's (the only host
    process on the per-token path; the engine process only sleeps) or a benchmark client's; returns what it
    achieved, e.g. ``"high (nice -10)"``. ``high``: nice -10, so where busy processes at nice 0 share a core this one
    gets ~10x their CPU share and its wake-ups preempt them. ``realtime``: SCHED_RR 10, so it runs whenever it is
    runnable; it sleeps between polls, and Linux keeps 5% of every core for normal tasks. ``auto``: high if this
    process may take it, else the best below.

    Invariant: a refused level never raises and never leaves the process half-raised: it carries on at the best level
    below it that is permitted (after nice -10, the lowest nice RLIMIT_NICE allows) and says so in one log line, a
    warning when ``level`` was asked for by name. Threads started afterwards inherit the result (``serve`` starts
    the engine before the agent calls this, and the engine resets its own: ``reset_priority``). ``option`` names the
    command-line option in the message."""
    if level not in PRIORITIES:
        raise ValueError(f"{option} must be one of {', '.join(PRIORITIES)} (got {level!r})")
    start = [name for name, _ in _LADDER].index("high" if level == "auto" else level)
    refused = []
    for _, raise_to in _LADDER[start:]:
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
                        ", ".join(refused), achieved, _ADVICE, _ADVICE_RT if level == "realtime" else "")
        return achieved
    raise AssertionError("unreachable: the normal level is always permitted")


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


# From the most privileged level down; a level's ladder starts at its first entry.
_LADDER = (("realtime", _realtime), ("high", _high), ("high", _rlimit_nice), ("normal", _normal))


def reset_priority() -> None:
    """Put the calling thread in the normal class at nice >= 0: the engine's entry calls it, so an engine never keeps
    a real-time class or a negative nice it inherited (from a raised agent, or a ``blink serve`` started under
    ``chrt`` / ``nice -n -5``). It only sleeps while the GPU schedules itself; a real-time engine that ever spun
    would starve its core. Lowering one's own priority is always permitted."""
    if os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if os.getpriority(os.PRIO_PROCESS, 0) < 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)

