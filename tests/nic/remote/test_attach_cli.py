"""``blink engine --listen`` and ``blink agent --remote``: in CPU mode the engine's ring in shared memory, the agent
attached through the setup handshake over the ipc transport (the foreign writer CPU mode can run) with the ring's
secret from its key file or from ``$BLINK_RING_SECRET``, its completion equal to the one an agent attached by name
gets from the same engine, and an agent without the secret refused in one line; on the H200 (``@pytest.mark.gpu``)
the engine keeps the ring's request side in GPU memory (``--request-side device``), the agent writes it through CUDA
IPC, and its completion equals that of an agent on the same model's host-memory ring."""
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
GPU_ENGINE = ["--device", "cuda", "--load-format", "dummy", "--num-pages", "256", "--slots", "4",
              "--max-prompt-tokens", "64", "--max-output-tokens", "16", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BLINK = (sys.executable, "-m", "blink.cli")     # the command, from this venv (tests/test_packaging.py: from another)


def blink(*args, command=BLINK, **options) -> subprocess.Popen:
    return subprocess.Popen([*command, *args], **options)


def interrupted(process: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGINT ``process``, then its exit status; one still running after ``timeout_s`` prints its threads' stacks on
    its stderr (SIGUSR1: ``report_stacks_on_sigusr1``) and fails the test."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        raise AssertionError(f"{process.args} did not exit within {timeout_s} s of SIGINT: its threads' stacks "
                             "are on its stderr") from None


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


def accepting(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def completion_through(agent_args: list[str], model_dir, prompt="remote", **options) -> str:
    """Start ``blink agent`` with ``agent_args`` (``options``: ``blink``'s), ask one seeded completion, stop the
    agent; its text."""
    port = free_port()
    agent = blink("agent", *agent_args, "--model", str(model_dir), "--port", str(port), "--served-model-name", "m",
                  **options)
    try:
        wait_for(lambda: healthy(port), timeout_s=120)
        status, body = request(port, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 5, "seed": 2})
        assert status == 200, body
        assert interrupted(agent) == 0
        return json.loads(body)["choices"][0]["text"]
    finally:
        agent.kill()


def healthy_ring(name: str) -> bool:
    """The shared-memory ring ``name`` exists and its control block is written."""
    from blink.ring.control import MAGIC

    try:
        with open(f"/dev/shm/{name}", "rb") as f:
            return int.from_bytes(f.read(4), "little") == MAGIC
    except FileNotFoundError:
        return False


def refusal(agent_args: list[str], model_dir, **options) -> str:
    """What ``blink agent`` with ``agent_args`` says when it may not attach (it must exit 1 without a traceback)."""
    agent = blink("agent", *agent_args, "--model", str(model_dir), stderr=subprocess.PIPE, text=True, **options)
    _, stderr = agent.communicate(timeout=60)
    assert agent.returncode == 1 and "Traceback" not in stderr, stderr
    return stderr


def test_an_agent_attached_through_the_listener_answers_like_one_attached_by_name(tmp_path):
    from blink.models import default_model_path
    from blink.ring import secret

    model_dir = default_model_path()
    ring, listen = f"blink-test-remote-{os.getpid()}", f"127.0.0.1:{free_port()}"
    env = {name: value for name, value in os.environ.items() if name != secret.ENV}
    with open(tmp_path / "engine.log", "w") as log:
        engine = blink("engine", str(model_dir), "--ring", ring, "--listen", listen, *CLI_ENGINE, env=env, stderr=log)
    try:
        wait_for(lambda: healthy_ring(ring), timeout_s=120)
        by_name = completion_through(["--ring", ring], model_dir, env=env)
        remote = completion_through(["--remote", listen, "--transport", "ipc", "--ring-key", ring], model_dir, env=env)
        assert remote == by_name and remote
        with open(secret.key_path(ring)) as f:      # as an operator hands it to an agent that cannot see the file
            out_of_band = {**env, secret.ENV: f.read()}
        assert completion_through(["--remote", listen, "--transport", "ipc"], model_dir, env=out_of_band) == by_name
        for ring_secret, shown in ((None, "no proof"), ("a guess", "a wrong proof")):
            stderr = refusal(["--remote", listen, "--transport", "ipc"], model_dir,
                             env={**env, secret.ENV: ring_secret} if ring_secret else env)
            assert f"rejected this agent: this agent showed {shown} of the ring's secret: set $BLINK_RING_SECRET" \
                in stderr, stderr
        stderr = refusal(["--remote", listen, "--transport", "rdma"], model_dir, env=env)
        assert "pyverbs" in stderr or "RDMA" in stderr, stderr
        assert interrupted(engine) == 0
        assert not os.path.exists(f"/dev/shm/{ring}") and not os.path.exists(f"/dev/shm/{ring}.key")
    finally:
        engine.kill()
    logged = (tmp_path / "engine.log").read_text()
    assert logged.count("refused agents from 127.0.0.1") == 1 and "no proof" in logged, logged


@pytest.mark.gpu
def test_an_agent_writing_the_gpu_memory_ring_through_cuda_ipc_answers_like_one_on_the_host_ring(tmp_path):
    from blink.bench.shapes import write_model_dir

    model_dir = write_model_dir(tmp_path / "tiny", "tiny-qwen3")       # random weights of seed 0 in both engines
    prompt = [5, 17, 99, 3, 250]
    ring = f"blink-test-gpu-ring-{os.getpid()}"
    host = blink("engine", str(model_dir), "--ring", ring, *GPU_ENGINE)
    try:
        wait_for(lambda: healthy_ring(ring), timeout_s=300)
        want = completion_through(["--ring", ring], model_dir, prompt)
        assert interrupted(host) == 0
    finally:
        host.kill()
    listen = f"127.0.0.1:{free_port()}"
    device = blink("engine", str(model_dir), "--ring", ring, "--listen", listen, "--request-side", "device",
                   *GPU_ENGINE)
    try:
        wait_for(lambda: accepting(listen), timeout_s=300)
        assert "not the one its engine serves" in refusal(["--ring", ring], model_dir)
        assert completion_through(["--remote", listen, "--transport", "ipc", "--ring-key", ring], model_dir,
                                  prompt) == want and want
        assert interrupted(device) == 0
        assert not os.path.exists(f"/dev/shm/{ring}")
    finally:
        device.kill()


def test_blink_agent_refuses_another_users_ring_in_one_line():
    """Issue 38 #2 from the command line: another local user's fake engine (a ring with a valid control block and a
    key file of its own, under the name the user gives ``blink agent --ring``) is refused, saying whose it is."""
    from blink.models import default_model_path
    from blink.ring import secret
    from blink.ring.geometry import RingGeometry
    from blink.ring.layout import RingLayout
    from tests.privileges import run_as, second_user_reason, unused_uid

    if reason := second_user_reason():
        pytest.skip(reason)
    ring = f"blink-test-fake-{os.getpid()}"
    layout = RingLayout(RingGeometry(n_slots=2, max_prompt_tokens=8, max_output_tokens=8))
    ring_bytes = layout.control_bytes().ljust(layout.size, b"\0")
    fake = run_as(unused_uid(), f"""
import os
for path, data in (({secret.key_path(ring)!r}, b"the fake engine's"),
                   ({"/dev/shm/" + ring!r}, bytes.fromhex({ring_bytes.hex()!r}))):
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, data)
""")
    try:
        assert fake.returncode == 0, fake.stderr
        stderr = refusal(["--ring", ring], default_model_path())
        assert f"/dev/shm/{ring} belongs to uid" in stderr and "run the agent as that user" in stderr, stderr
    finally:
        for path in (f"/dev/shm/{ring}", secret.key_path(ring)):
            if os.path.exists(path):
                os.unlink(path)
