"""blink.host.priority: each level where permitted; a refused level carries on at the best permitted one with one line
(tested by dropping CAP_SYS_NICE); an unknown level is refused by name."""
import os

import pytest

from tests.privileges import may_raise_priority, run_python

LOGGING = "import logging; logging.basicConfig(level=logging.INFO, format='blink: %(message)s'); "
no_cap_sys_nice = pytest.mark.skipif(may_raise_priority(unprivileged=True),
                                     reason="this user keeps CAP_SYS_NICE (or a raised RLIMIT_NICE): nothing to drop")



def permitted(call: str) -> bool:
    return run_python(f"import os; {call}").returncode == 0


def set_priority_in_a_subprocess(level: str, before: str = "", unprivileged: bool = False):
    """``set_priority(level)`` after ``before``; prints what it achieved, then the policy and nice it left."""
    return run_python(f"import os; {LOGGING}from blink.host.priority import set_priority; {before}"
                      f"print(set_priority({level!r})); print(os.sched_getscheduler(0), "
                      "os.getpriority(os.PRIO_PROCESS, 0))", unprivileged=unprivileged)


@pytest.mark.skipif(not permitted("os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))"),
                    reason="needs CAP_SYS_NICE and a real-time budget")
def test_each_priority_is_applied_where_permitted():
    achieved = {level: set_priority_in_a_subprocess(level) for level in ("normal", "high", "realtime", "auto")}
    assert achieved["normal"].stdout == "normal\n0 0\n"
    assert achieved["high"].stdout == f"high (nice -10)\n{os.SCHED_OTHER} -10\n"
    assert achieved["realtime"].stdout == f"realtime (SCHED_RR 10)\n{os.SCHED_RR} 0\n"
    assert achieved["auto"].stdout == f"high (nice -10)\n{os.SCHED_OTHER} -10\n"
    assert all(done.returncode == 0 for done in achieved.values())
    assert achieved["auto"].stderr == "blink: --agent-priority auto: high (nice -10)\n"
    assert achieved["high"].stderr == achieved["realtime"].stderr == ""


@no_cap_sys_nice
@pytest.mark.parametrize("level", ["high", "realtime"])
def test_a_refused_priority_says_so_once_and_carries_on_at_normal(level):
    """Without CAP_SYS_NICE the process keeps running, at the best level permitted, with one warning that names
    what was refused and what to do (no traceback, no exit: `blink serve` must not stop with its engine started)."""
    done = set_priority_in_a_subprocess(level, unprivileged=True)
    assert done.returncode == 0 and done.stdout == f"normal\n{os.SCHED_OTHER} 0\n", done.stderr
    (line,) = done.stderr.splitlines()
    refused = {"high": "nice -10 (Permission denied)",
               "realtime": "SCHED_RR 10 (Operation not permitted), nice -10 (Permission denied)"}[level]
    assert line.startswith(f"blink: --agent-priority {level}: {refused} not permitted; running at normal. "
                           "To raise it: it needs CAP_SYS_NICE (root) or a raised RLIMIT_NICE / RLIMIT_RTPRIO")
    assert ("without a real-time budget (cpu.rt_runtime_us)" in line) == (level == "realtime")


@no_cap_sys_nice
def test_auto_takes_the_best_permitted_level_in_one_info_line():
    done = set_priority_in_a_subprocess("auto", unprivileged=True)
    assert done.returncode == 0 and done.stdout.startswith("normal\n"), done.stderr
    assert done.stderr == "blink: --agent-priority auto: normal (nice -10 (Permission denied) not permitted)\n"


@no_cap_sys_nice
def test_a_raised_rlimit_nice_is_used_where_nice_minus_10_is_refused():
    """RLIMIT_NICE 25 lets a process without CAP_SYS_NICE down to nice -5: `high` carries on there."""
    raise_limit = "import resource; resource.setrlimit(resource.RLIMIT_NICE, (25, 25)); "
    if not permitted(raise_limit):
        pytest.skip("raising RLIMIT_NICE needs CAP_SYS_RESOURCE here")
    done = set_priority_in_a_subprocess("high", raise_limit, unprivileged=True)
    assert done.returncode == 0 and done.stdout == f"nice -5 (RLIMIT_NICE)\n{os.SCHED_OTHER} -5\n", done.stderr
    assert "nice -10 (Permission denied) not permitted; running at nice -5 (RLIMIT_NICE)" in done.stderr


def test_an_unknown_level_is_a_value_error():
    done = run_python("from blink.host.priority import set_priority; set_priority('max', '--client-priority')")
    want = "ValueError: --client-priority must be one of auto, normal, high, realtime, deadline (got 'max')"
    assert want in done.stderr


DEADLINE_LINE = "deadline (SCHED_DEADLINE 0.5 ms every 1 ms, not pinned)"
THREADS = ("import threading; from concurrent.futures import ThreadPoolExecutor; "
           "from blink.host.priority import helper_priority, is_deadline, reset_priority; "
           "state = lambda: (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)); ")
deadline_permitted = pytest.mark.skipif(
    not run_python("from blink.host.priority import set_priority; "
                   "assert set_priority('deadline').startswith('deadline')").returncode == 0,
    reason="needs CAP_SYS_NICE and a host whose scheduling domain this process spans")


@deadline_permitted
def test_deadline_runs_the_thread_in_sched_deadline_and_its_threads_in_the_normal_class():
    """The class the kernel reports (6, reset on fork: 0x40000000), and by sched_getattr its flags (reset on fork,
    reclaim), budget, deadline and period; threads it starts are normal (the kernel refuses a deadline thread's clone
    otherwise), at nice 0, or nice -10 through ``helper_priority``; ``reset_priority`` (the engine's entry) takes the
    class away."""
    done = run_python(f"import os; {LOGGING}from blink.host.priority import set_priority; {THREADS}"
                      "print(set_priority('deadline')); print(os.sched_getscheduler(0), is_deadline()); "
                      "import ctypes, platform; from blink.host.priority import _SCHED_ATTR, _SYSCALLS; "
                      "out = ctypes.create_string_buffer(_SCHED_ATTR.size); "
                      "ctypes.CDLL(None).syscall(_SYSCALLS[platform.machine()][1], 0, out, _SCHED_ATTR.size, 0); "
                      "print(*_SCHED_ATTR.unpack(out.raw)[1:3], *_SCHED_ATTR.unpack(out.raw)[5:]); "
                      "plain = []; t = threading.Thread(target=lambda: plain.append(state())); t.start(); t.join(); "
                      "print(*plain[0], *ThreadPoolExecutor(1, initializer=helper_priority).submit(state).result()); "
                      "reset_priority(); print(*state(), is_deadline())")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines() == [DEADLINE_LINE, f"{0x40000006} True", "6 3 500000 1000000 1000000",
                                        f"{os.SCHED_OTHER} 0 {os.SCHED_OTHER} -10", f"{os.SCHED_OTHER} 0 False"]


@deadline_permitted
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_deadline_refused_to_a_pinned_thread_carries_on_at_high_and_says_why():
    core = min(os.sched_getaffinity(0))
    done = set_priority_in_a_subprocess("deadline", f"os.sched_setaffinity(0, {{{core}}}); ")
    assert done.returncode == 0 and done.stdout == f"high (nice -10)\n{os.SCHED_OTHER} -10\n", done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("blink: --agent-priority deadline: SCHED_DEADLINE (Operation not permitted) not "
                           "permitted; running at high (nice -10). To raise it: it needs CAP_SYS_NICE")
    assert line.endswith("SCHED_DEADLINE is also refused to a process whose cores (cpuset, taskset) do not span the "
                         "host's scheduling domain")


@no_cap_sys_nice
def test_deadline_without_cap_sys_nice_carries_on_at_normal():
    done = set_priority_in_a_subprocess("deadline", unprivileged=True)
    assert done.returncode == 0 and done.stdout == f"normal\n{os.SCHED_OTHER} 0\n", done.stderr
    assert done.stderr.startswith("blink: --agent-priority deadline: SCHED_DEADLINE (Operation not permitted), "
                                  "nice -10 (Permission denied) not permitted; running at normal.")



@deadline_permitted
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to name one")
def test_pin_leaves_a_deadline_thread_unpinned_and_warns_about_cores_named_by_the_user():
    core, allowed = min(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(0))
    pinned = run_python(f"import os; {LOGGING}from blink.host.priority import pin; pin([{core}], named=True); "
                        "print(sorted(os.sched_getaffinity(0)))")
    assert pinned.returncode == 0 and pinned.stdout == f"[{core}]\n" and pinned.stderr == "", pinned.stderr
    for named, warning in ((True, f"blink: --agent-priority deadline runs the agent unpinned: --cpus {core} only "
                                  "keeps the engine off them\n"), (False, "")):
        done = run_python(f"import os; {LOGGING}from blink.host.priority import pin, set_priority; "
                          f"set_priority('deadline'); pin([{core}], named={named}); "
                          "print(sorted(os.sched_getaffinity(0)))")
        assert done.returncode == 0 and done.stdout == f"{allowed}\n", done.stderr
        assert done.stderr == warning
