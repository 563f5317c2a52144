"""The tested recipe of docs/deploy.md ("Behind HAProxy"): three ``blink serve --standin`` replicas on loopback behind
HAProxy, run with the configuration printed in that page, and a load through it (streamed and non-streamed
completions from several threads) while replica r1 drains and replica r2 is killed.

r1's engine process is paused (SIGSTOP) before its SIGTERM, so that the requests it holds are still in flight while
it drains; it resumes once HAProxy has marked r1 down. r2 gets SIGKILL mid-load. What must hold:

- no request is lost but a stream that r2 had already begun to answer: every other request, whatever replica the
  router first sent it to, completes with every token (HAProxy resends what r2 refused, dropped unanswered, or never
  took, and what r1 refused with 503 while draining);
- every request r1 held when it began to drain completes, and r1 exits 0 leaving no ring behind;
- HAProxy marks r1 down within a health check of its SIGTERM and sends it nothing more; r3 serves everything after.

HAProxy must be installed (README's test command installs it): without it this test fails, saying so.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from tests.nic.openai.test_server import free_port, wait_for
from tests.test_deploy import code_block
from tests.test_faults import engines, rings
from tests.test_lifecycle import in_flight

REPLICAS = ("r1", "r2", "r3")           # the servers of the recipe's backend
STANDIN = ("--standin", "--slots", "8", "--max-model-len", "128")
MAX_TOKENS = 24


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("the router test needs HAProxy: apt-get install -y haproxy (README's test command does so)")
    return found


@dataclass
class Replica:
    name: str
    port: int
    process: subprocess.Popen
    engine: int = 0                     # its stand-in engine's pid, once it serves


def start_replicas() -> dict[str, Replica]:
    replicas = {}
    for name in REPLICAS:
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--port", str(port), *STANDIN])
        replicas[name] = Replica(name, port, process)
    for replica in replicas.values():
        wait_for(lambda: get(replica.port, "/readyz") == 200, timeout_s=120)
        (replica.engine,) = engines(replica.process.pid)
    return replicas


def get(port: int, path: str) -> int | None:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", path)
        return connection.getresponse().status
    except OSError:
        return None


class Router:
    """HAProxy with the recipe's configuration, the replicas' addresses from the environment."""

    def __init__(self, replicas: dict[str, Replica], workdir):
        self.port, self.socket = free_port(), str(workdir / "haproxy.sock")
        config = workdir / "haproxy.cfg"
        config.write_text(code_block("haproxy"))
        env = {**os.environ, "HAPROXY_SOCKET": self.socket, "BLINK_ROUTER": f"127.0.0.1:{self.port}"}
        env |= {f"BLINK_REPLICA_{i}": f"127.0.0.1:{r.port}" for i, r in enumerate(replicas.values(), 1)}
        self.process = subprocess.Popen([haproxy_binary(), "-f", str(config), "-db"], env=env)
        wait_for(lambda: all(self.status(name) == "UP" for name in replicas), timeout_s=10)

    def servers(self) -> dict[str, dict]:
        """HAProxy's ``show stat`` of the backend's servers, by name."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.socket)
            s.sendall(b"show stat\n")
            text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
        header, *rows = [line.split(",") for line in text.strip().splitlines()]
        fields = [name.lstrip("# ") for name in header]
        return {row[1]: dict(zip(fields, row)) for row in rows if row[0] == "blink" and row[1] in REPLICAS}

    def status(self, name: str) -> str:
        try:
            return self.servers()[name]["status"].split()[0]
        except OSError:
            return "no router"

    def sessions(self, name: str) -> int:
        """Requests HAProxy has sent to replica ``name`` so far (retries included)."""
        return int(self.servers()[name]["stot"])


@dataclass
class Outcome:
    stream: bool
    started: float
    ended: float
    replica: str | None                 # X-Blink-Replica: who answered (the last one tried)
    complete: bool
    detail: str                         # the status and the end of the body, or the error


class Load:
    """Completions through the router from ``threads`` threads until ``finish()``, alternately streamed."""

    def __init__(self, port: int, threads: int = 6):
        self.port, self.outcomes, self.stop = port, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            self.outcomes.append(self._one(stream=bool((i + n) % 2), prompt=[1 + i, 2 + n % 50, 3]))

    def _one(self, stream: bool, prompt: list[int]) -> Outcome:
        body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream})
        started, replica, complete = time.monotonic(), None, False
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            replica = response.getheader("X-Blink-Replica")
            text = response.read().decode()
            complete = response.status == 200 and answered_in_full(text, stream)
            detail = f"{response.status} {text[-300:]}"
        except (OSError, http.client.HTTPException) as e:
            detail = repr(e)            # cut off: not complete
        return Outcome(stream, started, time.monotonic(), replica, complete, detail)

    def finish(self) -> list[Outcome]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self.threads), "a request hangs"
        return self.outcomes


def answered_in_full(body: str, stream: bool) -> bool:
    if stream:
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        return (body.endswith("data: [DONE]\n\n") and not any("error" in e for e in events)
                and events[-1]["choices"][0]["finish_reason"] == "length")
    usage = json.loads(body)["usage"]
    return usage["completion_tokens"] == MAX_TOKENS


@pytest.mark.slow
def test_a_drained_and_a_killed_replica_behind_haproxy_lose_no_request_the_router_could_resend(tmp_path):
    replicas, router = {}, None
    try:
        replicas = start_replicas()
        router = Router(replicas, tmp_path)
        r1, r2, r3 = (replicas[name] for name in REPLICAS)
        load = Load(router.port)
        time.sleep(1.5)

        os.kill(r1.engine, signal.SIGSTOP)          # r1's requests stay in flight
        wait_for(lambda: in_flight(r1.port) > 0, timeout_s=5)
        drain_at = time.monotonic()
        r1.process.send_signal(signal.SIGTERM)
        wait_for(lambda: router.status("r1") == "DOWN", timeout_s=3)
        sent_to_r1 = router.sessions("r1")

        kill_at = time.monotonic()
        r2.process.kill()
        os.kill(r2.engine, signal.SIGKILL)          # --standin's engine does not die with its parent
        wait_for(lambda: router.status("r2") == "DOWN", timeout_s=3)
        time.sleep(1.5)
        assert router.sessions("r1") == sent_to_r1, "HAProxy sent requests to a replica that was not ready"

        os.kill(r1.engine, signal.SIGCONT)
        assert r1.process.wait(30) == 0
        time.sleep(1.0)
        outcomes = load.finish()
        r3.process.send_signal(signal.SIGTERM)
        assert r3.process.wait(30) == 0
        assert not rings(r1.process.pid) and not rings(r3.process.pid), "a replica left its ring behind"
    finally:
        for replica in replicas.values():
            replica.process.kill()
            replica.process.wait(10)
            _kill(replica.engine)
            for name in rings(replica.process.pid):     # the killed one's: nothing of it could remove it
                os.unlink(f"/dev/shm/{name}")
        if router is not None:
            router.process.terminate()
            router.process.wait(10)

    lost = [o for o in outcomes if not o.complete]
    assert all(o.stream and o.replica == "r2" and o.started < kill_at for o in lost), lost
    assert len(lost) <= len(load.threads)
    drained = [o for o in outcomes if o.replica == "r1" and o.started < drain_at < o.ended]
    assert drained and all(o.complete for o in drained), "r1 did not finish what it held"
    assert all(o.started < drain_at for o in outcomes if o.replica == "r1"), "r1 served a request after SIGTERM"
    after = [o for o in outcomes if o.started > kill_at]
    assert after and all(o.replica == "r3" and o.complete for o in after)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
