"""``blink serve``'s life as an orchestrator sees it (docs/deploy.md). While its engine starts it listens: /livez
200, /readyz 503 "starting", requests 503. Under real signals (``--standin``): SIGTERM drains (readiness 503, new
requests 503 + Retry-After, the requests in flight finish, exit 0); at ``--drain-timeout`` the rest end with an error
and the exit is still 0; a second SIGTERM exits at once. Every time the engine process stops and its ring is removed.
Pausing the engine process (SIGSTOP) holds it in its start, or the requests in flight, for as long as the test needs.
"""
import http.client
import json
import os
import signal
import threading
import time
from contextlib import contextmanager

from blink.ring import control
from blink.ring.secret import SUFFIX
from blink.ring.transport import SharedMemory
from tests.nic.openai.test_server import CLI_ENGINE, blink_cli, free_port, wait_for
from tests.test_faults import engines, rings, serve

STANDIN = ("--standin", "--slots", "4", "--max-model-len", "128")


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), response.read().decode()


def initialised_ring(pid: int) -> bool:
    """Whether the engine of ``blink serve`` ``pid`` has written its ring's control block: what serve waits for
    before it listens (the key file comes first, then the ring, sized, then the block)."""
    for name in rings(pid) - {name for name in rings(pid) if name.endswith(SUFFIX)}:
        try:
            with SharedMemory.open(name) as memory:
                return control.decode(memory.read(0, control.CONTROL_DTYPE.itemsize))["creator_pid"] != 0
        except (FileNotFoundError, ValueError):
            return False
    return False


def in_flight(port: int) -> float:
    _, _, text = call(port, "GET", "/metrics")
    (line,) = [line for line in text.splitlines() if line.startswith("blink_http_requests_in_flight ")]
    return float(line.split()[1])


class Requests:
    """``n`` completions sent at once from threads, alternately streamed; ``answers()`` once they all ended."""

    def __init__(self, port: int, n: int):
        self.results = [None] * n
        self.threads = [threading.Thread(target=self._one, args=(port, i), daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()
        wait_for(lambda: in_flight(port) == n)

    def _one(self, port: int, i: int) -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 16, "ignore_eos": True, "stream": bool(i % 2)}
        self.results[i] = call(port, "POST", "/v1/completions", body)

    def answers(self, timeout_s: float = 30) -> list[tuple[int, dict, str]]:
        for thread in self.threads:
            thread.join(timeout_s)
        assert not any(thread.is_alive() for thread in self.threads), "a request hangs"
        return self.results


def complete(answer) -> bool:
    status, _, body = answer
    return status == 200 and '"error"' not in body and ("data: [DONE]" in body or '"length"' in body)


@contextmanager
def standin_serve(*options):
    """A ``blink serve --standin``, its engine process paused (SIGSTOP) inside; checks that nothing is left behind."""
    process, port = serve(*STANDIN, *options)
    (engine,) = engines(process.pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        yield process, port, engine
    finally:
        _resume(engine)
        process.kill()
        process.wait(10)
    wait_for(lambda: not os.path.exists(f"/proc/{engine}"), timeout_s=15)
    assert not rings(process.pid), "serve left its ring behind"


def test_sigterm_drains_what_is_in_flight_refuses_the_rest_then_exits_0():
    with standin_serve() as (process, port, engine):
        requests = Requests(port, 3)
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: call(port, "GET", "/readyz")[0] == 503)
        assert json.loads(call(port, "GET", "/readyz")[2])["status"] == "draining"
        assert call(port, "GET", "/livez")[0] == 200
        status, headers, body = call(port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 503 and headers["Retry-After"] == "1" and "draining" in body
        time.sleep(0.5)
        assert process.poll() is None, "serve stopped before its requests finished"
        os.kill(engine, signal.SIGCONT)
        assert process.wait(30) == 0
        assert all(map(complete, requests.answers()))


def test_ctrl_c_in_a_terminal_drains_too():
    """A terminal's Ctrl-C signals the whole process group, the engine process included: the engine keeps serving
    what is in flight while the agent drains, then both stop, exit 0, ring removed."""
    process, port = serve(*STANDIN, "--standin-step-ms", "50", own_group=True)
    (engine,) = engines(process.pid)
    try:
        requests = Requests(port, 3)                # 16 tokens at 50 ms a step: ~0.8 s in flight
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(30) == 0
        assert all(map(complete, requests.answers()))
    finally:
        process.kill()
        process.wait(10)
    wait_for(lambda: not os.path.exists(f"/proc/{engine}"), timeout_s=15)
    assert not rings(process.pid), "serve left its ring behind"


def test_at_the_drain_timeout_the_rest_end_with_an_error_and_the_exit_is_0():
    with standin_serve("--drain-timeout", "1") as (process, port, engine):
        requests = Requests(port, 2)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        answers = requests.answers()
        assert time.monotonic() - started >= 1
        assert all("drain deadline (1 s) passed" in body and not complete((s, h, body)) for s, h, body in answers)
        os.kill(engine, signal.SIGCONT)
        assert process.wait(30) == 0


def test_a_second_sigterm_exits_at_once():
    with standin_serve() as (process, port, engine):
        requests = Requests(port, 2)
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: call(port, "GET", "/readyz")[0] == 503)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        answers = requests.answers()
        assert time.monotonic() - started < 3
        assert all("second SIGINT/SIGTERM" in body for _, _, body in answers)
        os.kill(engine, signal.SIGCONT)        # a paused engine cannot take its shutdown word
        assert process.wait(15) == 0


def test_while_its_engine_starts_serve_is_live_and_not_ready():
    """The real engine, paused as soon as it has created its ring (before its model is loaded)."""
    port = free_port()
    process = blink_cli("serve", "--port", str(port), *CLI_ENGINE)
    engine = None
    try:
        wait_for(lambda: engines(process.pid), timeout_s=60)
        (engine,) = engines(process.pid)
        wait_for(lambda: initialised_ring(process.pid), timeout_s=120)
        os.kill(engine, signal.SIGSTOP)
        wait_for(lambda: port_open(port), timeout_s=60)
        status, _, body = call(port, "GET", "/livez")
        assert (status, json.loads(body)) == (200, {"status": "live"})
        assert json.loads(call(port, "GET", "/readyz")[2]) == {"status": "starting",
                                                               "reason": "the engine is still starting"}
        status, headers, _ = call(port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 503 and headers["Retry-After"] == "1"
        os.kill(engine, signal.SIGCONT)
        wait_for(lambda: call(port, "GET", "/readyz")[0] == 200, timeout_s=120)
        assert complete(call(port, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 4}))
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        wait_for(lambda: not os.path.exists(f"/proc/{engine}"), timeout_s=30)
        assert not rings(process.pid)
    finally:
        if engine is not None:
            _resume(engine)
        process.kill()
        process.wait(10)


def port_open(port: int) -> bool:
    try:
        return call(port, "GET", "/livez")[0] > 0
    except OSError:
        return False


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
