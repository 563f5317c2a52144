"""Fault injection: the engine, or the agent, killed (SIGKILL) at random points while requests are in flight.

What must hold (docs/reliability.md): when the engine dies, every request in flight ends promptly with an error (a
status, or an error event in its stream; none hangs), and ``blink serve`` exits with code 1 for its supervisor,
leaving no ring behind; when the agent (``blink serve``) dies, its engine process stops by itself and removes its
ring.
"""
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.nic.openai.test_server import _healthy as healthy
from tests.nic.openai.test_server import free_port, wait_for
from tests.nic.openai.test_server import engine_processes as engines

KILL_POINTS = random.Random(23).sample([x / 10 for x in range(2, 25)], 3)     # seconds into the load
CPU_ENGINE = ["--device", "cpu", "--slots", "8", "--max-model-len", "96", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "64", "--cpu-kv-cache-gib", "0.05"]


def serve(*args, own_group: bool = False, **popen) -> tuple[subprocess.Popen, int]:
    """``blink serve ARGS`` once healthy; ``own_group``: in a process group of its own, as a terminal starts it."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--port", str(port), *args],
                               start_new_session=own_group, **popen)
    wait_for(lambda: healthy(port), timeout_s=120)
    return process, port


def rings(pid: int) -> set[str]:
    """The rings ``blink serve`` process ``pid`` made (their names start with its pid)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"blink-{pid}-")}


class Load:
    """Streams requests from 8 threads until stopped; records how each ended and how long it took."""

    def __init__(self, port: int):
        self.port, self.ends, self.stop = port, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(8)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 64, "ignore_eos": True, "stream": True})
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                payload = response.read()
                end = ("error" if response.status != 200 or b'"error"' in payload
                       else "done" if payload.endswith(b"data: [DONE]\n\n") else "cut")
            except http.client.IncompleteRead:
                end = "cut"             # the response ended inside a chunk
            except OSError:
                end = "refused"         # the server is gone: a new request cannot connect
            self.ends.append((end, time.monotonic() - start))

    def finish(self) -> list:
        self.stop.set()
        for thread in self.threads:
            thread.join(40)
        assert not any(thread.is_alive() for thread in self.threads), "a request hangs"
        return self.ends


@pytest.mark.parametrize("kill_after_s", KILL_POINTS)
def test_an_engine_killed_under_load_fails_what_is_in_flight_and_serve_exits_1(kill_after_s):
    process, port = serve("--standin", "--slots", "8", "--max-model-len", "128")
    try:
        load = Load(port)
        time.sleep(kill_after_s)
        (engine,) = engines(process.pid)
        os.kill(engine, signal.SIGKILL)
        assert process.wait(30) == 1
        ends = load.finish()
    finally:
        process.kill()
    assert {end for end, _ in ends} <= {"done", "error", "refused"}, "a stream was cut off without an error"
    assert all(seconds < 30 for _, seconds in ends)
    assert not rings(process.pid), "serve left its ring behind"


@pytest.mark.parametrize("kill_after_s", KILL_POINTS[:2])
def test_an_agent_killed_under_load_takes_its_engine_and_ring_with_it(kill_after_s):
    process, port = serve(*CPU_ENGINE)
    (engine,) = engines(process.pid)
    load = Load(port)
    time.sleep(kill_after_s)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    load.finish()
    try:
        wait_for(lambda: not os.path.exists(f"/proc/{engine}") or _zombie(engine), timeout_s=60)
    except AssertionError:
        os.kill(engine, signal.SIGUSR1)  # its threads' stacks on the captured stderr (report_stacks_on_sigusr1)
        time.sleep(2)
        raise AssertionError("the engine did not stop within 60 s of its agent's death: its stacks are above") \
            from None
    wait_for(lambda: not rings(process.pid), timeout_s=10)


def test_an_engine_whose_step_raises_fails_what_is_in_flight_refuses_more_and_exits_non_zero():
    """An exception inside a model step (injected at step 30 by ``blink.faults``) kills the scheduler loop: every
    request in flight ends with an error, new ones are refused (503, never queued), the engine releases everything
    and exits non-zero, and ``blink serve`` exits 1 for its supervisor, leaving no ring behind."""
    from blink.faults import FAIL_STEP

    process, port = serve(*CPU_ENGINE, env={**os.environ, FAIL_STEP: "30"}, stderr=subprocess.PIPE, text=True)
    try:
        load = Load(port)
        assert process.wait(300) == 1
        ends = load.finish()
        stderr = process.stderr.read()
    finally:
        process.kill()
    assert {end for end, _ in ends} <= {"done", "error", "refused"}, "a stream was cut off without an error"
    assert "error" in {end for end, _ in ends}, "the requests in flight at the fault ended with an error"
    assert all(seconds < 30 for _, seconds in ends)
    assert "fault injected in model step 30" in stderr and "the engine process exited with code 1" in stderr, stderr
    assert not rings(process.pid), "serve left its ring behind"


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_step_faults_come_from_the_environment_and_a_bad_value_names_the_variable():
    from blink.faults import FAIL_STEP, SLOW_STEPS, InjectedFault, StepFaults

    faults = StepFaults.from_env({SLOW_STEPS: "3:0.01", FAIL_STEP: "5"})
    assert faults == StepFaults(slow_every=3, slow_s=0.01, fail_at=5)
    for step in range(1, 5):
        faults.before(step)
    with pytest.raises(InjectedFault, match="model step 5"):
        faults.before(5)
    assert StepFaults.from_env({}) == StepFaults()
    with pytest.raises(ValueError, match=SLOW_STEPS):
        StepFaults.from_env({SLOW_STEPS: "often"})
