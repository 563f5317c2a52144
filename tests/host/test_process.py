"""blink.host.process: the engine process's own priority and cores, a server's watch on an engine that does not
start, and what an engine that keeps its ring's request side in GPU memory needs (the engine process itself runs end
to end in tests/nic/openai/test_server.py; the priority ladder in tests/host/test_priority.py)."""
import os
import subprocess
import sys
import time

import pytest

from blink.host.process import pin_threads
from tests.privileges import run_python


def permitted(call: str) -> bool:
    return run_python(f"import os; {call}").returncode == 0


@pytest.mark.skipif(not permitted("os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))"),
                    reason="needs CAP_SYS_NICE and a real-time budget")
def test_an_engine_started_by_a_real_time_agent_runs_in_the_normal_class():
    """The engine only sleeps: whatever its parent runs at (here SCHED_RR and, before that, nice -10), it resets
    itself to SCHED_OTHER at nice 0 as it starts."""
    code = ("import os, uuid\n"
            "from blink import EngineConfig, SchedulerConfig\n"
            "from blink.nic.agent import Agent\n"
            "from blink.host.process import engine_process, wait_until_serving\n"
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
    its answer: the engine says it is inside a step, its process keeps ticking, and each model layer moves
    ``in_step`` (so that a step longer than the backend's step limit is not hung while it progresses)."""
    import uuid

    from blink import EngineConfig, SamplingParams, SchedulerConfig
    from blink.nic.agent import Agent
    from blink.host.process import engine_process, wait_until_serving

    config = EngineConfig(device="cpu", n_slots=2, sim_threads=2, cpu_kv_cache_gib=0.1,
                          ring_name=f"blink-test-long-{uuid.uuid4().hex[:8]}",
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024, max_model_len=1040))
    with engine_process(config) as (memory, process):
        agent = Agent.attach(memory, liveness_timeout_s=1.0)
        wait_until_serving(agent, process)
        agent.submit(list(range(1, 1001)), SamplingParams(max_tokens=2, temperature=0))
        start, first_token_s, in_step, reasons = time.monotonic(), None, set(), []
        while agent.in_flight:
            in_step.add(agent.stats()["in_step"])
            for out in agent.poll():
                if out.new_tokens and first_token_s is None:
                    first_token_s = time.monotonic() - start
                reasons.append(out.finish_reason)
            time.sleep(0.05)
    assert reasons[-1] == "length"
    assert first_token_s > 1.0, f"the prefill took {first_token_s:.2f} s: too short to test anything"
    assert max(in_step) > 1, f"in_step never moved inside a step (seen: {sorted(in_step)})"


def test_a_server_gives_up_on_an_engine_that_does_not_start_serving_in_time(local_ring):
    """``engine_watch``: a server listens while its engine starts, but not forever (``wait_until_serving``'s limit)."""
    from blink.host.process import engine_watch
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
    from blink.host.process import serve_ring

    with pytest.raises(ValueError, match="--request-side device.*needs --listen HOST:PORT"):
        serve_ring(EngineConfig(ring_name="blink-test-unused", request_side="device"))


def test_the_listener_of_an_engine_whose_ring_has_no_name_needs_the_secret_from_the_environment(monkeypatch):
    """No key file to take the secret from: refused before the engine starts, rather than a listener nobody can
    prove anything to."""
    from blink.config import EngineConfig
    from blink.host.process import serve_ring
    from blink.ring import secret

    monkeypatch.delenv(secret.ENV, raising=False)
    with pytest.raises(ValueError, match=r"ring has no name .* publishes no key file, so its listener needs "
                                         r"\$BLINK_RING_SECRET"):
        serve_ring(EngineConfig(ring_name=None), listen="127.0.0.1:0")


MAKE_RING = """
import sys, time
from blink.core import create_ring
from blink.ring.geometry import RingGeometry
ring = create_ring(sys.argv[1], RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=8))
print("made", flush=True)
time.sleep(120)
"""


def test_the_rings_of_killed_servers_are_swept_and_no_other():
    """Issue 38 #10: a whole-group crash (kill -9 of serve and its engine) left its ring and key in /dev/shm; the
    next server removes them, and only them: not a live engine's ring, nor a file that is not a ring of this blink."""
    import signal
    import subprocess
    import sys
    import uuid

    from blink.host.process import sweep_stale_rings
    from blink.ring import secret
    from blink.ring.transport import SharedMemory

    def path(name):
        return os.path.join(SharedMemory.SHM_DIR, name)

    tag = uuid.uuid4().hex[:8]
    dead, live, other = f"blink-{tag}-dead", f"blink-{tag}-live", f"blink-{tag}-not-a-ring"
    makers = {name: subprocess.Popen([sys.executable, "-c", MAKE_RING, name], stdout=subprocess.PIPE, text=True)
              for name in (dead, live)}
    try:
        for maker in makers.values():
            assert maker.stdout.readline() == "made\n"
        makers[dead].send_signal(signal.SIGKILL)
        makers[dead].wait()
        with open(path(other), "wb") as f:
            f.write(bytes(4096))
        assert os.path.exists(path(dead)) and os.path.exists(secret.key_path(dead)), "kill -9 leaves them"
        sweep_stale_rings()
        assert not os.path.exists(path(dead)) and not os.path.exists(secret.key_path(dead))
        assert os.path.exists(path(live)) and os.path.exists(secret.key_path(live)) and os.path.exists(path(other))
    finally:
        for maker in makers.values():
            maker.kill()
            maker.wait()
        for name in (dead, live, other):
            for leftover in (path(name), secret.key_path(name)):
                if os.path.exists(leftover):
                    os.unlink(leftover)


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    """``report_stacks_on_sigusr1``: how a test finds where a process that did not stop waits."""
    import signal

    code = ("import threading, time\n"
            "from blink.host.process import report_stacks_on_sigusr1\n"
            "report_stacks_on_sigusr1()\n"
            "def parked_in_a_helper(): time.sleep(60)\n"
            "threading.Thread(target=parked_in_a_helper, daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGUSR1)
        report, main_thread = [], False
        while not (main_thread and report[-1].startswith("  File")):  # the main thread's stack comes last
            report.append(process.stderr.readline())
            main_thread = main_thread or report[-1].startswith("Current thread")
            assert report[-1], "".join(report)  # the process ended before the report did
        assert process.poll() is None, "".join(report)  # it goes on
    finally:
        process.kill()
    assert "in parked_in_a_helper" in "".join(report), "".join(report)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's /proc/PID/task and two cores")
def test_pinning_a_process_pins_the_threads_it_had_started_and_those_it_starts_after():
    """Regression: only the engine's first thread was pinned; the threads it had started by then (torch's) kept every
    core, the agent's too, and ran matmuls there."""
    script = ("import sys, threading, time\n"
              "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
              "print('started', flush=True)\n"
              "sys.stdin.readline()\n"
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
              "print('again', flush=True)\n"
              "sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "started\n"
        core = {max(os.sched_getaffinity(0))}
        pin_threads(child.pid, core)

        def cores() -> list:
            return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{child.pid}/task")]
        assert len(cores()) >= 4 and all(c == core for c in cores()), cores()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "again\n"
        assert len(cores()) >= 5 and all(c == core for c in cores()), cores()
    finally:
        child.kill()
        child.wait()
