"""blink.priority: each level where permitted; a refused level carries on at the best permitted one with one line
(tested by dropping CAP_SYS_NICE); the short EEVDF slice a raised thread asks for, and the engine's reset of it."""
import os
import platform

import pytest

from tests.privileges import may_raise_priority, run_python

LOGGING = "import logging; logging.basicConfig(level=logging.INFO, format='blink: %(message)s'); "
no_cap_sys_nice = pytest.mark.skipif(may_raise_priority(unprivileged=True),
                                     reason="this user keeps CAP_SYS_NICE (or a raised RLIMIT_NICE): nothing to drop")
# Linux grants a normal task a slice of its own from 6.12 on (sched_setattr's sched_runtime): what set_priority must
# then report, read from the kernel's version, not from the code under test.
KERNEL = tuple(int(part) for part in platform.release().split("-")[0].split(".")[:2])
SLICE = "; 0.1 ms slice" if KERNEL >= (6, 12) and platform.machine() in ("x86_64", "aarch64") else ""
READ_SLICE = "int(open('/proc/thread-self/sched').read().split('se.slice')[1].split(':')[1].split()[0])"


def permitted(call: str) -> bool:
    return run_python(f"import os; {call}").returncode == 0


def set_priority_in_a_subprocess(level: str, before: str = "", unprivileged: bool = False):
    """``set_priority(level)`` after ``before``; prints what it achieved, then the policy and nice it left."""
    return run_python(f"import os; {LOGGING}from blink.priority import set_priority; {before}"
                      f"print(set_priority({level!r})); print(os.sched_getscheduler(0), "
                      "os.getpriority(os.PRIO_PROCESS, 0))", unprivileged=unprivileged)


@pytest.mark.skipif(not permitted("os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))"),
                    reason="needs CAP_SYS_NICE and a real-time budget")
def test_each_priority_is_applied_where_permitted():
    achieved = {level: set_priority_in_a_subprocess(level) for level in ("normal", "high", "realtime", "auto")}
    assert achieved["normal"].stdout == "normal\n0 0\n"
    assert achieved["high"].stdout == f"high (nice -10){SLICE}\n{os.SCHED_OTHER} -10\n"
    assert achieved["realtime"].stdout == f"realtime (SCHED_RR 10)\n{os.SCHED_RR} 0\n"
    assert achieved["auto"].stdout == f"high (nice -10){SLICE}\n{os.SCHED_OTHER} -10\n"
    assert all(done.returncode == 0 for done in achieved.values())
    assert achieved["auto"].stderr == f"blink: --agent-priority auto: high (nice -10){SLICE}\n"
    assert achieved["high"].stderr == achieved["realtime"].stderr == ""


@no_cap_sys_nice
@pytest.mark.parametrize("level", ["high", "realtime"])
def test_a_refused_priority_says_so_once_and_carries_on_at_normal(level):
    """Without CAP_SYS_NICE the process keeps running, at the best level permitted, with one warning that names
    what was refused and what to do (no traceback, no exit: `blink serve` must not stop with its engine started)."""
    done = set_priority_in_a_subprocess(level, unprivileged=True)
    assert done.returncode == 0 and done.stdout == f"normal{SLICE}\n{os.SCHED_OTHER} 0\n", done.stderr
    (line,) = done.stderr.splitlines()
    refused = {"high": "nice -10 (Permission denied)",
               "realtime": "SCHED_RR 10 (Operation not permitted), nice -10 (Permission denied)"}[level]
    assert line.startswith(f"blink: --agent-priority {level}: {refused} not permitted; running at normal{SLICE}. "
                           "To raise it: it needs CAP_SYS_NICE (root) or a raised RLIMIT_NICE / RLIMIT_RTPRIO")
    assert ("without a real-time budget (cpu.rt_runtime_us)" in line) == (level == "realtime")


@no_cap_sys_nice
def test_auto_takes_the_best_permitted_level_in_one_info_line():
    done = set_priority_in_a_subprocess("auto", unprivileged=True)
    assert done.returncode == 0 and done.stdout.startswith(f"normal{SLICE}\n"), done.stderr
    assert done.stderr == f"blink: --agent-priority auto: normal{SLICE} (nice -10 (Permission denied) not permitted)\n"


@no_cap_sys_nice
def test_a_raised_rlimit_nice_is_used_where_nice_minus_10_is_refused():
    """RLIMIT_NICE 25 lets a process without CAP_SYS_NICE down to nice -5: `high` carries on there."""
    raise_limit = "import resource; resource.setrlimit(resource.RLIMIT_NICE, (25, 25)); "
    if not permitted(raise_limit):
        pytest.skip("raising RLIMIT_NICE needs CAP_SYS_RESOURCE here")
    done = set_priority_in_a_subprocess("high", raise_limit, unprivileged=True)
    assert done.returncode == 0 and done.stdout == f"nice -5 (RLIMIT_NICE){SLICE}\n{os.SCHED_OTHER} -5\n", done.stderr
    assert f"nice -10 (Permission denied) not permitted; running at nice -5 (RLIMIT_NICE){SLICE}" in done.stderr


def test_an_unknown_level_is_a_value_error():
    done = run_python("from blink.priority import set_priority; set_priority('max', '--client-priority')")
    assert "ValueError: --client-priority must be one of auto, normal, high, realtime (got 'max')" in done.stderr


@pytest.mark.skipif(not SLICE, reason="this kernel grants no slice of a task's own (Linux 6.12 or later does)")
@pytest.mark.parametrize("unprivileged", [False, True])
def test_a_raised_thread_gets_a_short_slice_a_normal_one_keeps_the_default_and_the_engine_gives_it_back(unprivileged):
    """The slice as the kernel shows it (/proc/thread-self/sched): 0.1 ms after set_priority('auto'), with or without
    CAP_SYS_NICE; the default after set_priority('normal') and after reset_priority (the engine's entry)."""
    done = run_python(f"from blink.priority import reset_priority, set_priority; default = {READ_SLICE}; "
                      f"set_priority('normal'); print({READ_SLICE} == default); "
                      f"set_priority('auto'); print({READ_SLICE}); reset_priority(); print({READ_SLICE} == default)",
                      unprivileged=unprivileged)
    assert done.returncode == 0 and done.stdout == "True\n100000\nTrue\n", done.stderr
