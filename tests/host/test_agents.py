"""blink.host.agents: ``blink serve --agent-processes 2`` end to end, over the stand-in engine and the real CPU engine.
Reference: the same requests' answers from a one-process server (temperature 0, seeded), and the ring itself, read
here: each agent process's slots are the range it locks in the ring's file (``/proc/PID/fdinfo``), and the ring's
slots and counters say what the processes did. Pausing the engine process (SIGSTOP) holds requests in the ring for as
long as a test needs, with no timing assumed."""
import asyncio
import glob
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from blink.ring import control
from blink.ring.layout import FREE, RingLayout
from blink.ring.secret import SUFFIX
from blink.ring.transport import SharedMemory
from tests.nic.openai.test_server import CLI_ENGINE, _healthy, engine_processes, free_port, wait_for
from tests.test_faults import _zombie as zombie
from tests.test_faults import rings
from tests.test_lifecycle import Requests, call, complete, in_flight
from tests.test_lifecycle import _resume as resume

KEY = "sesame"
MODEL = "agents-test"
# The engine is paused for as long as a test needs: a liveness timeout that a loaded box never reaches meanwhile.
PATIENT = ("--served-model-name", MODEL, "--liveness-timeout", "60")
STANDIN = ("--standin", "--slots", "8", "--max-model-len", "128", "--standin-step-ms", "2", *PATIENT)


@dataclass
class Server:
    """A ``blink serve`` whose log (its agent processes' too) goes to ``log``."""

    process: subprocess.Popen
    port: int
    log: Path

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def agents(self) -> dict[int, int]:
        """Agent process index -> pid (the latest started)."""
        found = (re.search(r"agent process (\d+) of \d+: pid (\d+)", line) for line in self.lines())
        return {int(m[1]): int(m[2]) for m in found if m}

    def listening(self) -> int:
        return sum("serving" in line and " on http://" in line for line in self.lines())

    def engine(self) -> int:
        (pid,) = set(engine_processes(self.process.pid)) - set(self.agents().values())
        return pid

    @contextmanager
    def ring(self):
        """The ring's status words and control block (numpy views of it, in this process)."""
        (name,) = {name for name in rings(self.process.pid) if not name.endswith(SUFFIX)}
        with SharedMemory.open(name) as memory:
            view = RingLayout(control.geometry_of(memory.read(0, control.CONTROL_DTYPE.itemsize))).view(memory.buffer)
            yield view
            del view

    def metrics(self) -> dict[str, float]:
        """/metrics, each sample summed over its labels other than the finish reason's."""
        values = {}
        for line in call(self.port, "GET", "/metrics")[2].splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                name = re.sub(r"\{(?!finish_reason).*\}", "", series)
                values[name] = values.get(name, 0.0) + float(value)
        return values

    @contextmanager
    def paused_engine(self):
        """The engine process stopped (SIGSTOP) inside the block, or until ``resume()``."""
        engine = self.engine()
        os.kill(engine, signal.SIGSTOP)
        try:
            yield lambda: resume(engine)
        finally:
            resume(engine)


def start(log: Path, *options, agents: int = 2) -> Server:
    """``blink serve OPTIONS --agent-processes AGENTS``, once every agent process listens."""
    port = free_port()
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--port", str(port),
                                    "--agent-processes", str(agents), *options], stderr=stderr)
    server = Server(process, port, log)
    try:
        wait_for(lambda: process.poll() is not None or server.listening() >= agents and _healthy(port),
                 timeout_s=180)
        assert process.poll() is None, log.read_text()
    except BaseException:
        process.kill()
        raise
    return server


@contextmanager
def serving(log: Path, *options, agents: int = 2):
    """``start``, then stopped (SIGTERM: exit 0), leaving no process and no ring behind."""
    server = start(log, *options, agents=agents)
    process = server.process
    try:
        spawned = set(engine_processes(process.pid))
        yield server
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-3000:]
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in spawned), timeout_s=30)
        assert not rings(process.pid), "serve left its ring behind"
    finally:
        process.kill()
        process.wait(10)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "key"
    path.write_text(KEY)
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, key_file):
    with serving(tmp_path_factory.mktemp("pair") / "serve.log", *STANDIN, "--api-key-file", key_file) as server:
        yield server


@pytest.fixture(scope="module")
def single(tmp_path_factory, key_file):
    with serving(tmp_path_factory.mktemp("single") / "serve.log", *STANDIN, "--api-key-file", key_file,
                 agents=1) as server:
        yield server


def locked_slots(server: Server, pid: int) -> list[range]:
    """The slots agent process ``pid`` holds: the bytes ``1 + slot`` it locks in the ring's file (its other locks,
    byte 0, are the creator's, on descriptors it inherited none of)."""
    (name,) = {name for name in rings(server.process.pid) if not name.endswith(SUFFIX)}
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != f"/dev/shm/{name}":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        for first, last in re.findall(r"^lock:.*OFDLCK.*WRITE\s+-?\d+\s+\S+\s+(\d+)\s+(\d+)$", info, re.M):
            held.add(range(int(first) - 1, int(last)))
    return sorted(held, key=lambda r: r.start)


async def stream_all(server: Server, requests: list[dict], chat: bool = False, until=None) -> list[tuple]:
    """Send ``requests`` at once as streams through the OpenAI client; ``until()`` (if given) is awaited while they
    are in flight. Each answer: its text, finish reason and completion tokens."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)

    async def one(body):
        create = client.chat.completions.create if chat else client.completions.create
        chunks = await create(model=MODEL, stream=True, stream_options={"include_usage": True}, **body)
        text, finish, usage = "", None, None
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += (choice.delta.content or "") if chat else choice.text
                finish = choice.finish_reason or finish
        return text, finish, usage.completion_tokens

    tasks = [asyncio.create_task(one(body)) for body in requests]
    if until is not None:
        await until()
    return await asyncio.gather(*tasks)


def test_each_agent_process_holds_its_own_range_of_the_ring(pair):
    ranges = {index: locked_slots(pair, pid) for index, pid in pair.agents().items()}
    assert ranges == {0: [range(0, 4)], 1: [range(4, 8)]}
    logged = {int(m[1]): range(int(m[2]), int(m[3]) + 1) for line in pair.lines()
              if (m := re.search(r"\[agent (\d)\] slots (\d+)-(\d+) of the ring's 8", line))}
    assert logged == {0: range(0, 4), 1: range(4, 8)}


def test_concurrent_streams_get_every_token_in_order_as_from_one_process(pair, single):
    """32 streams at once: with the engine paused both ranges fill (each process took requests into its own
    slots), then every stream gets the text and token count the one-process server gives the same request."""
    requests = [{"prompt": [i, i + 1, 7], "max_tokens": 10 + i % 5, "seed": i, "temperature": 0} for i in range(32)]

    with pair.paused_engine() as resume, pair.ring() as ring:
        async def both_ranges_fill():
            async with asyncio.timeout(60):
                while not (ring.status["state"] != FREE).all():     # 32 connections: each process got 4 or more
                    await asyncio.sleep(0.01)
            resume()

        got = asyncio.run(stream_all(pair, requests, until=both_ranges_fill))
    want = asyncio.run(stream_all(single, requests))
    assert got == want and all(finish in ("stop", "length") for _, finish, _ in got)


def test_metrics_sum_the_processes_and_report_the_engine_once(pair):
    before = pair.metrics()
    requests = [{"prompt": [3, 4, 5, i], "max_tokens": 6, "seed": i} for i in range(12)]
    asyncio.run(stream_all(pair, requests))
    wait_for(lambda: pair.metrics()["blink_http_requests_in_flight"] == 0, timeout_s=60)
    after = pair.metrics()
    with pair.ring() as ring:
        tokens = int(ring.control["tokens"][0])
    finished = [name for name in after if name.startswith("blink_requests_finished_total")]
    assert sum(after[n] - before.get(n, 0) for n in finished) == 12
    assert after["blink_prompt_tokens_total"] - before["blink_prompt_tokens_total"] == 12 * 4
    assert after["blink_time_to_first_token_seconds_count"] - before["blink_time_to_first_token_seconds_count"] == 12
    assert after["vllm:time_to_first_token_seconds_count"] == after["blink_time_to_first_token_seconds_count"]
    assert after["blink_generation_tokens_total"] == tokens, "the engine's counters once, not once per process"
    assert after["blink_ring_slots"] == after["blink_ring_free_slots"] == 8
    assert after["blink_ready"] == 2 and after["blink_draining"] == 0
    assert after["blink_requests_max_queued"] == 1024, "--max-queued 1024 split in two, rounded up"
    assert after["process_cpu_seconds_total"] > 0 and "blink_agent_run_delay_seconds_total" in after


def test_client_disconnects_cancel_their_requests_in_every_process(pair):
    """16 streams on 8 slots, the engine paused: those in the ring, the rest queued in the processes; every client
    leaves. Those in the ring finish as "abort", the queued ones never reach it, every slot is FREE again."""
    body = json.dumps({"prompt": [9, 9], "max_tokens": 50, "ignore_eos": True, "stream": True}).encode()
    before = pair.metrics()
    with pair.ring() as ring:
        state, cancel, epoch = ring.status["state"], ring.status["cancel"], ring.status["epoch"]
        cancelled = int(ring.control["cancelled"][0])
        with pair.paused_engine():
            socks = []
            for _ in range(16):
                sock = socket.create_connection(("127.0.0.1", pair.port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (KEY.encode(), len(body), body))
                socks.append(sock)
            wait_for(lambda: (metrics := pair.metrics())["blink_http_requests_in_flight"] == 16
                     and metrics["blink_requests_queued"] + (state != FREE).sum() == 16, timeout_s=60)
            in_ring = (state != FREE).nonzero()[0]
            assert {slot < 4 for slot in in_ring} == {True, False}, "both processes took requests"
            for sock in socks:
                sock.close()
            wait_for(lambda: (cancel[in_ring] == epoch[in_ring]).all(), timeout_s=30)
            # Each process drops its queued requests once it has seen their clients go; on a busy box that can come
            # after the in-ring cancels, and a slot freed before it would take a queued request (then cancelled).
            wait_for(lambda: pair.metrics()["blink_requests_queued"] == 0, timeout_s=30)
        wait_for(lambda: (state == FREE).all(), timeout_s=30)
        assert int(ring.control["cancelled"][0]) == cancelled + len(in_ring)
    wait_for(lambda: pair.metrics()["blink_http_requests_in_flight"] == 0, timeout_s=60)
    after = pair.metrics()
    aborted = 'blink_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 16 and after["blink_requests_queued"] == 0


def test_an_api_key_is_asked_for_by_every_process(pair):
    for _ in range(16):         # fresh connections: the kernel spreads them over both processes
        assert call(pair.port, "GET", "/v1/models")[0] == 401
        status, _, body = call(pair.port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert call(pair.port, "GET", "/health")[0] == 200
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.port}/v1", api_key=KEY, max_retries=0)
    assert all(client.models.list().data for _ in range(4))


def test_sigusr1_prints_an_agent_processs_stacks_and_it_serves_on(pair):
    """``kill -USR1`` of an agent process reports where its threads are, as it does for serve's other processes
    (where one that does not answer waits), and the process goes on: it had no handler, and the signal killed it."""
    agent = pair.agents()[1]
    reports = sum(line.startswith("Current thread") for line in pair.lines())
    os.kill(agent, signal.SIGUSR1)
    wait_for(lambda: sum(line.startswith("Current thread") for line in pair.lines()) > reports, timeout_s=30)
    assert os.path.exists(f"/proc/{agent}") and pair.agents()[1] == agent, pair.lines()[-20:]
    for _ in range(16):         # fresh connections: the kernel spreads them over both processes
        assert call(pair.port, "GET", "/health")[0] == 200


def test_sigterm_drains_every_process_then_the_engine_stops(tmp_path):
    """The first SIGTERM reaches every agent process (the parent forwards it): each answers /readyz 503 "draining"
    and new requests 503, the requests in flight finish, then the engine stops and the exit code is 0."""
    with serving(tmp_path / "serve.log", *STANDIN) as server:
        with server.paused_engine() as resume:
            requests = Requests(server.port, 6)
            server.process.send_signal(signal.SIGTERM)
            wait_for(lambda: all(json.loads(call(server.port, "GET", "/readyz")[2])["status"] == "draining"
                                 for _ in range(16)), timeout_s=60)      # fresh connections: both processes
            status, headers, body = call(server.port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
            assert status == 503 and "draining" in body and in_flight(server.port) == 6
            assert server.process.poll() is None, "serve stopped before its requests finished"
            resume()
            assert server.process.wait(60) == 0
        assert all(map(complete, requests.answers()))


def stream(port: int, ends: list) -> None:
    """One streamed completion: "done" (every chunk, then [DONE]) or "dropped" (its connection ended first)."""
    body = {"prompt": [5, 6], "max_tokens": 40, "ignore_eos": True, "stream": True}
    try:
        status, _, text = call(port, "POST", "/v1/completions", body)
        ends.append("done" if status == 200 and text.endswith("data: [DONE]\n\n") else f"status {status}")
    except (OSError, http.client.HTTPException):
        ends.append("dropped")


def test_a_killed_agent_process_is_started_again_its_slots_come_back_and_the_other_serves_on(tmp_path):
    """kill -9 of agent process 1 while both hold requests (the engine paused): its clients' connections drop,
    agent process 0's requests finish; the parent starts process 1 again on the same slots, which finishes what
    the dead one left in the ring (cancelled, freed), and the server serves as before."""
    with serving(tmp_path / "serve.log", *STANDIN) as server, server.ring() as ring:
        status, before = ring.status, int(ring.control["cancelled"][0])
        dead = server.agents()[1]
        ends: list[str] = []
        with server.paused_engine():
            clients = [threading.Thread(target=stream, args=(server.port, ends)) for _ in range(16)]
            for client in clients:
                client.start()
            wait_for(lambda: in_flight(server.port) == 16, timeout_s=60)
            left = 4 + (status["state"][4:] != FREE).nonzero()[0]
            assert left.size and (status["state"][:4] != FREE).any(), "both processes hold requests"
            os.kill(dead, signal.SIGKILL)
            wait_for(lambda: ends.count("dropped") >= left.size, timeout_s=30)
            wait_for(lambda: server.listening() == 3 and server.agents()[1] != dead, timeout_s=120)
            # The successor cancels what its predecessor left running or waiting in the ring.
            wait_for(lambda: (status["cancel"][left] == status["epoch"][left]).all(), timeout_s=30)
        for client in clients:
            client.join(60)
        assert not any(client.is_alive() for client in clients), "a request hangs"
        assert set(ends) == {"done", "dropped"} and len(ends) == 16
        assert any(f"agent process 1 of 2 (pid {dead}) exited (code -9): starting it again" in line
                   for line in server.lines())
        assert locked_slots(server, server.agents()[1]) == [range(4, 8)]
        wait_for(lambda: (status["state"] == FREE).all(), timeout_s=30)
        assert int(ring.control["cancelled"][0]) == before + left.size
        ends.clear()
        for _ in range(16):
            stream(server.port, ends)
        assert ends == ["done"] * 16


def test_the_cpu_engine_behind_two_processes_answers_as_behind_one(tmp_path):
    """The real engine (SmolLM2 on the CPU): 24 streams at once, greedy, each process holding requests in its own
    slots; every stream's text and token count are those of a one-process server."""
    requests = [{"prompt": f"Item {i}: the colour of the sky is", "max_tokens": 6 + i % 3, "temperature": 0}
                for i in range(24)]
    with serving(tmp_path / "one.log", *CLI_ENGINE, *PATIENT, agents=1) as single:
        want = asyncio.run(stream_all(single, requests))
    with serving(tmp_path / "two.log", *CLI_ENGINE, *PATIENT) as pair:
        with pair.paused_engine() as resume, pair.ring() as ring:
            async def both_ranges_fill():       # 24 connections: each process got 2 or more
                async with asyncio.timeout(60):
                    while not (ring.status["state"] != FREE).all():
                        await asyncio.sleep(0.01)
                resume()

            got = asyncio.run(stream_all(pair, requests, until=both_ranges_fill))
    assert got == want and all(n > 0 for _, _, n in got)


def test_a_killed_serve_takes_its_agent_processes_engine_and_ring_with_it(tmp_path):
    """kill -9 of ``serve`` itself: its engine and its agent processes get the parent-death signal and stop, and the
    engine removes its ring (the CPU engine makes it)."""
    server = start(tmp_path / "serve.log", *CLI_ENGINE, *PATIENT)
    spawned = engine_processes(server.process.pid)
    assert len(spawned) == 3, "the engine and two agent processes"
    server.process.kill()
    server.process.wait(10)
    wait_for_exits(server, spawned, timeout_s=60)
    wait_for(lambda: not rings(server.process.pid), timeout_s=10)
    # Its metrics directory is left behind, and the next server's removes it.
    from blink.nic.metrics import shared_metrics

    left = glob.glob(os.path.join(tempfile.gettempdir(), f"blink-metrics-{server.process.pid}-*"))
    assert len(left) == 1
    with shared_metrics():
        assert not os.path.exists(left[0])


def wait_for_exits(server: Server, pids: list[int], timeout_s: float) -> None:
    """Wait until every process of ``pids`` has exited (a zombie counts); else fail naming those left, each with its
    state, and the log's end, where each left has printed its threads' stacks (SIGUSR1)."""
    def left() -> list[int]:
        return [pid for pid in pids if os.path.exists(f"/proc/{pid}") and not zombie(pid)]

    try:
        wait_for(lambda: not left(), timeout_s=timeout_s)
    except AssertionError:
        states = {pid: _state(pid) for pid in left()}
        for pid in states:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)
        pytest.fail(f"still running {timeout_s:g} s after serve was killed: {states} (agent pids {server.agents()}); "
                    f"the log's end:\n{server.log.read_text()[-8000:]}")


def _state(pid: int) -> str:
    """The process's ``State:`` line of ``/proc/PID/status`` ("exited" if it has gone meanwhile)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(line.split(None, 1)[1].strip() for line in status if line.startswith("State:"))
    except FileNotFoundError:
        return "exited"


def test_an_agent_process_that_cannot_start_stops_the_server_with_exit_code_1(tmp_path):
    """Here the API key file is missing, which each agent process reads as it starts: rather than be started again
    for ever, the server stops, saying why in one line, exit code 1, nothing left behind."""
    serve = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--port", str(free_port()), *STANDIN,
                              "--agent-processes", "2", "--api-key-file", str(tmp_path / "missing")],
                             stderr=subprocess.PIPE, text=True)
    _, stderr = serve.communicate(timeout=180)
    assert serve.returncode == 1 and "Traceback" not in stderr, stderr
    assert re.search(r"blink serve: agent process \d: --api-key-file \S+: cannot read the key", stderr)
    assert re.search(r"agent process \d of 2 exited \(code 1\) before it listened: stopping the server", stderr)
    assert "starting it again" not in stderr and not rings(serve.pid)


@pytest.mark.parametrize("cores,slots,agents", [(1, 256, 1), (2, 256, 1), (15, 256, 1), (16, 256, 2), (64, 256, 8),
                                               (256, 256, 8), (64, 3, 3)])
def test_the_default_is_one_agent_process_per_eight_cores_within_the_slots(cores, slots, agents):
    from blink.host.agents import default_agent_processes

    assert default_agent_processes(cores, slots) == agents
