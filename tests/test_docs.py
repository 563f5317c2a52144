"""Every shell and Python snippet of README.md, docs/*.md and docs/benchmarks/*.md runs here, as written: none rots.

A fenced ``python`` or ``bash`` block is preceded by a comment saying how it runs: ``<!-- snippet: run -->``
(executed: Python with ``python -c``, shell with ``bash -e``), ``<!-- snippet: server -->`` (executed while
``blink serve`` with the embedded model runs on 127.0.0.1:8000, within an optional time bound in seconds:
``server 20``), ``<!-- snippet: daemon -->`` (each command starts a server: all are started in order, must come up
and keep running, then are stopped with Ctrl-C), ``<!-- snippet: ci -->`` (the install-and-test command that
``.ci/run`` itself runs), ``<!-- snippet: gpu -->`` (needs the H200; not run here), ``<!-- snippet: docker -->`` (needs
a Docker daemon: run where ``docker info`` answers, skipped elsewhere) or ``<!-- snippet: host -->`` (changes the
host's configuration, as root: cgroups, systemd; not run here). A snippet inside a list item may be
indented, its comment with it.
"""
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- snippet: (?P<kind>[\w]+)(?: (?P<arg>[^-]+?))? -->\n[ \t]*)?```(?P<lang>python|bash|sh)\n"
                   r"(?P<code>.*?)\n[ \t]*```", re.S)
KINDS = ("run", "server", "daemon", "ci", "gpu", "docker", "host")


def snippets():
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text[:m.start("lang")].count("\n") + 1
            found.append(pytest.param(m["kind"], m["arg"], m["lang"], m["code"],
                                      id=f"{path.relative_to(ROOT)}:{line}:{m['kind']}"))
    return found


SNIPPETS = snippets()


def test_every_snippet_says_how_it_runs():
    unmarked = [p.id for p in SNIPPETS if p.values[0] not in KINDS]
    assert not unmarked, f"snippets without a <!-- snippet: KIND --> comment ({'|'.join(KINDS)}): {unmarked}"


def test_ci_runs_the_readme_s_install_and_test_command():
    (code,) = [p.values[3] for p in SNIPPETS if p.values[0] == "ci"]
    readme = [line for line in code.splitlines() if "pytest" in line]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert readme and readme == ci, f"README.md's test command {readme} differs from .ci/run's {ci}"


def execute(lang: str, code: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run a snippet as a user does: shell with ``bash -e``; Python saved as a script and run (a process that
    multiprocessing spawns imports the script again, which ``python -c`` would hide)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"     # the venv's commands, as if activated
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "snippet.py"
        script.write_text(code)
        command = [sys.executable, str(script)] if lang == "python" else ["bash", "-e", "-c", code]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(port: int) -> bool:
    done = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/health"], capture_output=True)
    return done.returncode == 0


@pytest.fixture(scope="module")
def server():
    """``blink serve`` as the README starts it, on the CPU; the snippets that talk to a server use it."""
    if listening(8000):
        pytest.fail("port 8000 is taken: the snippets talk to a server there")
    process = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--device", "cpu"], cwd=ROOT)
    deadline = time.monotonic() + 300
    while not healthy(8000):
        assert process.poll() is None and time.monotonic() < deadline, "blink serve did not come up"
        time.sleep(0.2)
    yield
    process.send_signal(signal.SIGINT)
    process.wait(60)


@pytest.mark.parametrize("kind,arg,lang,code", [p for p in SNIPPETS if p.values[0] == "run"])
def test_snippet_runs(kind, arg, lang, code):
    done = execute(lang, code, float(arg or 300))
    assert done.returncode == 0, done.stderr[-3000:]


def docker_daemon() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("kind,arg,lang,code", [p for p in SNIPPETS if p.values[0] == "docker"])
def test_docker_snippet_runs_where_a_daemon_is(kind, arg, lang, code):
    if not docker_daemon():
        pytest.skip("no Docker daemon answers (docker info): the Dockerfile is linted by the run snippet of gpu.md")
    done = execute(lang, code, float(arg or 3600))
    assert done.returncode == 0, done.stderr[-3000:]


def timed_alone(params: list) -> list:
    """A snippet that promises a time (``<!-- snippet: server 20 -->``) promises it on a host that runs nothing else:
    it runs with the serial tests, as beside another test file it waits for cores (CI: 20.2 s against 20)."""
    return [pytest.param(*p.values, id=p.id, marks=[pytest.mark.serial] if p.values[1] else []) for p in params]


@pytest.mark.parametrize("kind,arg,lang,code", timed_alone([p for p in SNIPPETS if p.values[0] == "server"]))
def test_snippet_runs_against_the_server(server, kind, arg, lang, code):
    start = time.monotonic()
    done = execute(lang, code, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    if arg:
        assert time.monotonic() - start < float(arg), f"took {time.monotonic() - start:.1f} s, promised {arg}"


def up(command: str) -> bool:
    """A server the command starts is up: its /health answers (``--port``), or the ring it creates (``--ring`` of
    ``blink engine``) exists and is initialised."""
    words = shlex.split(command)
    if "--port" in words:
        return healthy(int(words[words.index("--port") + 1]))
    ring = Path("/dev/shm") / words[words.index("--ring") + 1]
    return ring.is_file() and ring.stat().st_size > 0 and ring.read_bytes()[:4] == b"BLNK"


def ring_of(command: str) -> str | None:
    words = shlex.split(command)
    return words[words.index("--ring") + 1] if "--ring" in words else None


def wait_up(command: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while not up(command):
        assert process.poll() is None and time.monotonic() < deadline, f"{command!r} did not come up"
        time.sleep(0.2)


@pytest.mark.parametrize("kind,arg,lang,code", [p for p in SNIPPETS if p.values[0] == "daemon"])
def test_snippet_servers_come_up_and_stop_on_ctrl_c(kind, arg, lang, code):
    commands = [c for c in (line.split("#")[0].strip() for line in code.splitlines()) if c]
    assert all("--port" in c or "--ring" in c for c in commands), "each server needs a --port (or --ring) of its own"
    started = []
    try:
        # Started in order without waiting for each other (each start is seconds of imports and model loading), but
        # one that names the --ring of an earlier command (``blink agent --ring``) only once that ring is up.
        for command in commands:
            for earlier, process in zip(commands, started):
                if ring_of(command) is not None and ring_of(earlier) == ring_of(command):
                    wait_up(earlier, process)
            started.append(subprocess.Popen(shlex.split(command), cwd=ROOT))
        for command, process in zip(commands, started):
            wait_up(command, process)
        assert all(p.poll() is None for p in started), "a server stopped by itself"
    finally:
        for process in reversed(started):
            process.send_signal(signal.SIGINT)
            assert process.wait(60) == 0
