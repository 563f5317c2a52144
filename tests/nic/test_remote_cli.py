"""``blink engine --listen`` and ``blink agent --remote`` in CPU mode: the engine's ring in shared memory, the agent
attached through the setup handshake over the ipc transport (the foreign writer CPU mode can run), its completion
equal to the one an agent attached by name gets from the same engine.

Skips until ``blink.cli`` has the two options (the wiring the report of the smartnic branch describes)."""
import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

CLI_ENGINE = ["--device", "cpu", "--slots", "4", "--max-prompt-tokens", "64", "--max-output-tokens", "16",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--cpu-kv-cache-gib", "0.05"]


def cli_options(command: str) -> set[str]:
    from blink.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(commands.choices[command]._option_string_actions)


pytestmark = pytest.mark.skipif(
    not ("--remote" in cli_options("agent") and "--listen" in cli_options("engine")),
    reason="needs the cli wiring of blink agent --remote / blink engine --listen")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blink(*args, **options) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "blink.cli", *args], **options)


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def request(port: int, path: str, body: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST" if body else "GET", path, json.dumps(body) if body else None,
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def healthy(port: int) -> bool:
    try:
        return request(port, "/health")[0] == 200
    except OSError:
        return False


def completion_through(agent_args: list[str], model_dir) -> str:
    """Start ``blink agent`` with ``agent_args``, ask one seeded completion, stop the agent; its text."""
    port = free_port()
    agent = blink("agent", *agent_args, "--model", str(model_dir), "--port", str(port), "--served-model-name", "m")
    try:
        wait_for(lambda: healthy(port), timeout_s=120)
        status, body = request(port, "/v1/completions", {"model": "m", "prompt": "remote", "max_tokens": 5, "seed": 2})
        assert status == 200, body
        agent.send_signal(signal.SIGINT)
        assert agent.wait(60) == 0
        return json.loads(body)["choices"][0]["text"]
    finally:
        agent.kill()


def test_an_agent_attached_through_the_listener_answers_like_one_attached_by_name():
    from blink.models import default_model_path
    from blink.ring.control import MAGIC

    model_dir = default_model_path()
    ring, listen = f"blink-test-remote-{os.getpid()}", f"127.0.0.1:{free_port()}"
    engine = blink("engine", str(model_dir), "--ring", ring, "--listen", listen, *CLI_ENGINE)
    try:
        def ring_ready():
            with open(f"/dev/shm/{ring}", "rb") as f:
                return int.from_bytes(f.read(4), "little") == MAGIC
        wait_for(lambda: os.path.exists(f"/dev/shm/{ring}") and ring_ready(), timeout_s=120)
        by_name = completion_through(["--ring", ring], model_dir)
        remote = completion_through(["--remote", listen, "--transport", "ipc"], model_dir)
        assert remote == by_name and remote
        no_rdma = blink("agent", "--remote", listen, "--transport", "rdma", "--model", str(model_dir),
                        stderr=subprocess.PIPE, text=True)
        _, stderr = no_rdma.communicate(timeout=60)
        assert no_rdma.returncode == 1 and "Traceback" not in stderr
        assert "pyverbs" in stderr or "RDMA" in stderr, stderr
        engine.send_signal(signal.SIGINT)
        assert engine.wait(60) == 0
        assert not os.path.exists(f"/dev/shm/{ring}")
    finally:
        engine.kill()
