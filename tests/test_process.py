"""blink.process: CPU priorities of the host's processes, and a server's watch on an engine that does not start (the
engine process itself runs end to end in tests/nic/openai/test_server.py)."""
import os
import subprocess
import sys
import time


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def raising_priority_is_permitted() -> bool:
    return run_python("import os; os.setpriority(os.PRIO_PROCESS, 0, -10)").returncode == 0


def test_agent_priority_is_applied_or_refused_with_a_clear_error():
    high = run_python("import os; from blink.process import set_priority; set_priority('high'); "
                      "print(os.getpriority(os.PRIO_PROCESS, 0))")
    realtime = run_python("import os; from blink.process import set_priority; set_priority('realtime'); "
                          "print(os.sched_getscheduler(0) == os.SCHED_RR)")
    if raising_priority_is_permitted():
        assert (high.returncode, high.stdout) == (0, "-10\n"), high.stderr
        assert (realtime.returncode, realtime.stdout) == (0, "True\n"), realtime.stderr
    else:
        assert high.returncode == 1 and "--agent-priority high: not permitted" in high.stderr
    # An unprivileged user may not raise its priority: one line that says what to do, no traceback.
    unprivileged = "os.setgid(65534); os.setuid(65534); " if os.geteuid() == 0 else ""
    denied = run_python(f"import os; from blink.process import set_priority; {unprivileged}"
                        "set_priority('realtime')")
    assert denied.returncode == 1 and "Traceback" not in denied.stderr
    assert "--agent-priority realtime: not permitted" in denied.stderr
    assert "Use --agent-priority normal." in denied.stderr


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
