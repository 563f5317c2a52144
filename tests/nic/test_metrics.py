"""blink.nic.metrics: the event loop thread's waits for a core reach /metrics, as Linux's schedstat counts them for
that thread, and its cores' steal time, as /proc/stat counts it. (The stall and GC counters:
tests/nic/test_agent_loop.py.)"""
import asyncio
import os
import subprocess
import sys

import pytest

from tests.nic.openai.local import run_local

RUN_DELAY = "blink_agent_run_delay_seconds_total"
STEAL = "blink_agent_cores_steal_seconds_total"
SCHEDSTAT = "/proc/thread-self/schedstat"


def waited_s() -> float:
    """The calling thread's time runnable but not running, by the kernel."""
    with open(SCHEDSTAT) as f:
        return int(f.read().split()[1]) / 1e9


@pytest.mark.skipif(not os.path.exists(SCHEDSTAT), reason="needs Linux's per-thread schedstat")
def test_the_loop_threads_waits_for_a_busy_core_are_counted(local_ring, tokenizer):
    async def scenario(local):
        before = waited_s()             # this thread runs the event loop, the agent's included
        first = (await local.metrics())[RUN_DELAY]
        allowed = os.sched_getaffinity(0)
        core = min(allowed)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            os.sched_setaffinity(spinner.pid, {core})
            os.sched_setaffinity(0, {core})      # this thread only: it now shares one core with the spinner
            for _ in range(50):
                await asyncio.sleep(0.002)       # each wake-up finds the core busy
        finally:
            os.sched_setaffinity(0, allowed)
            spinner.kill()
            spinner.wait()
        second = (await local.metrics())[RUN_DELAY]
        assert before <= first < second <= waited_s()
        assert second - first >= 0.001, "50 wake-ups beside a spinner on one core waited at least 1 ms in all"

    run_local(local_ring, tokenizer, scenario, serve=True)


def steal_s(cores) -> float:
    """/proc/stat's steal of ``cores``, read here independently of blink: the 8th value of each ``cpuN`` line."""
    with open("/proc/stat") as f:
        rows = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    return sum(int(row[8]) for row in rows if int(row[0][3:]) in cores) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_the_steal_time_of_the_loop_threads_cores_is_counted(local_ring, tokenizer):
    """The counter lies between two reads of the same cores' steal around the scrape (on bare metal all three are
    0); and they are the loop thread's cores: pinned to one, the counter is that core's steal alone."""
    async def scenario(local):
        allowed = os.sched_getaffinity(0)
        before = steal_s(allowed)
        scraped = (await local.metrics())[STEAL]
        assert before <= scraped <= steal_s(allowed)
        core = max(allowed)
        os.sched_setaffinity(0, {core})          # this thread runs the event loop
        try:
            before = steal_s({core})
            scraped = (await local.metrics())[STEAL]
            assert before <= scraped <= steal_s({core})
        finally:
            os.sched_setaffinity(0, allowed)

    run_local(local_ring, tokenizer, scenario, serve=True)
