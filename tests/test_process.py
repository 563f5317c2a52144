"""blink.process: CPU priorities of the host's processes, and a server's watch on an engine that does not start (the
engine process itself runs end to end in tests/nic/openai/test_server.py)."""
import os
import time

import pytest

from tests.privileges import may_raise_priority, run_python

LOGGING = "import logging; logging.basicConfig(level=logging.INFO, format='blink: %(message)s'); "
no_cap_sys_nice = pytest.mark.skipif(may_raise_priority(unprivileged=True),
                                     reason="this user keeps CAP_SYS_NICE (or a raised RLIMIT_NICE): nothing to drop")


def permitted(call: str) -> bool:
    return run_python(f"import os; {call}").returncode == 0


def set_priority_in_a_subprocess(level: str, before: str = "", unprivileged: bool = False):
    """``set_priority(level)`` after ``before``; prints what it achieved, then the policy and nice it left."""
    return run_python(f"import os; {LOGGING}from blink.process import set_priority; {before}"
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
    done = run_python("from blink.process import set_priority; set_priority('max', '--client-priority')")
    assert "ValueError: --client-priority must be one of auto, normal, high, realtime (got 'max')" in done.stderr


@pytest.mark.skipif(not permitted("os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))"),
                    reason="needs CAP_SYS_NICE and a real-time budget")
def test_an_engine_started_by_a_real_time_agent_runs_in_the_normal_class():
    """The engine only sleeps: whatever its parent runs at (here SCHED_RR and, before that, nice -10), it resets
    itself to SCHED_OTHER at nice 0 as it starts."""
    code = ("import os, uuid\n"
            "from blink import EngineConfig, SchedulerConfig\n"
            "from blink.nic.agent import Agent\n"
            "from blink.process import engine_process, wait_until_serving\n"
            "os.setpriority(os.PRIO_PROCESS, 0, -10)\n"
            "os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))\n"
            "config = EngineConfig(device='cpu', n_slots=2, sim_threads=1, cpu_kv_cache_gib=0.05, "
            "ring_name=f'blink-test-rt-{uuid.uuid4().hex[:8]}', scheduler=SchedulerConfig(max_num_seqs=1, "
            "max_num_batched_tokens=64, max_model_len=128))\n"
            "with engine_process(config) as (memory, process):\n"
            "    wait_until_serving(Agent.attach(memory), process)\n"
            "    print(os.sched_getscheduler(process.pid), os.getpriority(os.PRIO_PROCESS, process.pid))\n")
    done = run_python(code, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{os.SCHED_OTHER} 0\n"


def test_a_long_cpu_step_is_not_taken_for_a_dead_engine():
    """Regression (false liveness alarms): on the CPU a long prefill outlasted the agent's liveness timeout and the
    request failed with 503. With a 1 s timeout, a prefill of 1,000 tokens (several seconds on a 2-core box) runs to
    its answer: the engine says it is inside a step, and its process keeps ticking."""
    import uuid

    from blink import EngineConfig, SamplingParams, SchedulerConfig
    from blink.nic.agent import Agent
    from blink.process import engine_process, wait_until_serving

    config = EngineConfig(device="cpu", n_slots=2, sim_threads=2, cpu_kv_cache_gib=0.1,
                          ring_name=f"blink-test-long-{uuid.uuid4().hex[:8]}",
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024, max_model_len=1040))
    with engine_process(config) as (memory, process):
        agent = Agent.attach(memory, liveness_timeout_s=1.0)
        wait_until_serving(agent, process)
        agent.submit(list(range(1, 1001)), SamplingParams(max_tokens=2, temperature=0))
        start, first_token_s, saw_in_step, reasons = time.monotonic(), None, False, []
        while agent.in_flight:
            saw_in_step |= bool(agent.stats()["in_step"])
            for out in agent.poll():
                if out.new_tokens and first_token_s is None:
                    first_token_s = time.monotonic() - start
                reasons.append(out.finish_reason)
            time.sleep(0.05)
    assert reasons[-1] == "length"
    assert saw_in_step and first_token_s > 1.0, f"the prefill took {first_token_s:.2f} s: too short to test anything"


def test_a_server_gives_up_on_an_engine_that_does_not_start_serving_in_time(local_ring):
    """``engine_watch``: a server listens while its engine starts, but not forever (``wait_until_serving``'s limit)."""
    from blink.process import engine_watch
    from blink.ring import control
    from blink.ring.geometry import RingGeometry

    memory, agent, _ = local_ring(RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=8))
    gone = engine_watch(agent, start_timeout_s=0.3)
    assert gone() is None
    time.sleep(0.4)
    assert gone() == "the engine did not start serving within 0.3 s"
    control.write(memory, "engine_state", control.ENGINE_SERVING)
    assert gone() is None


def test_an_engine_with_its_request_side_in_gpu_memory_needs_a_listener():
    from blink.config import EngineConfig
    from blink.process import serve_ring

    with pytest.raises(ValueError, match="--request-side device.*needs --listen HOST:PORT"):
        serve_ring(EngineConfig(ring_name="blink-test-unused", request_side="device"))
