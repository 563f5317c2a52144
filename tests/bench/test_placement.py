"""blink.bench.placement: the layouts of ``blink bench serve --interference`` (hogs everywhere, or kept off a
reserved core set where the server and the client run), checked against the cores this process may use."""
import os
import subprocess
import sys

import pytest

from blink.bench.placement import Layout, layout
from blink.host.cores import cpu_list

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))


def test_by_default_the_hogs_run_everywhere_and_the_client_is_not_pinned():
    shared = layout(None, None)
    assert (shared.hog_cpus, shared.client_cpus, shared.reserved) == (ALLOWED, None, ())
    assert shared.describe() == f"layout shared: hogs on cores {cpu_list(ALLOWED)}; client on any core"


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores this process may use")
def test_reserved_cores_are_kept_from_the_hogs_and_hold_the_client():
    last = ALLOWED[-1]
    reserved = layout([last], None)
    assert reserved.hog_cpus == ALLOWED[:-1] and reserved.client_cpus == (last,) and reserved.name == "reserved"
    assert f"cores {last} kept from them (a server's: taskset -c {last} blink serve ...; or a client's alone" in \
        reserved.describe()
    assert layout([last], [ALLOWED[0]]).client_cpus == (ALLOWED[0],), "--client-cpus puts the client elsewhere"
    assert reserved.as_json() == {"name": "reserved", "hog_cpus": list(ALLOWED[:-1]), "reserved": [last],
                                  "client_cpus": [last]}


def test_layouts_that_cannot_be_run_are_refused_in_a_sentence():
    with pytest.raises(ValueError, match=r"leaves none of the cores .* for the hogs: reserve fewer"):
        layout(list(ALLOWED), None)
    with pytest.raises(ValueError, match=r"--client-cpus 4096: this process may only use cores"):
        layout(None, [4096])
    with pytest.raises(ValueError, match="the hogs may not run on the reserved cores"):
        Layout((0, 1), (0, 1), None, (1,))


def test_a_cpuset_of_one_core_cannot_reserve_it():
    """In a process that may use one core (a cgroup cpuset, taskset), that core is all there is for the hogs."""
    core = ALLOWED[-1]
    code = (f"import os; os.sched_setaffinity(0, {{{core}}}); from blink.bench.placement import layout\n"
            f"print(layout(None, None).describe())\n"
            f"try:\n    layout([{core}], None)\nexcept ValueError as e: print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [
        f"layout shared: hogs on cores {core}; client on any core",
        f"--reserve-cpus {core} leaves none of the cores {core} for the hogs: reserve fewer"], done.stderr


@pytest.mark.skipif(len(ALLOWED) < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs two cores this process may use and Linux's /proc/PID/task")
def test_the_client_is_pinned_with_every_thread_it_has():
    """Regression: only the calling thread was pinned; a thread the client had started at import kept every core."""
    last = ALLOWED[-1]
    code = ("import os, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "from blink.bench.placement import layout, pin_client\n"
            f"pin_client(layout([{last}], None))\n"
            "print(sorted({tuple(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"[({last},)]", done.stderr
