"""The distribution as users install it: ``pip install blink-serve`` (from the wheels built here of this tree and its
dependencies, ``--no-index``) into a fresh venv is the core install, the agent, without torch or numba
(docs/dpu.md): ``blink agent --remote`` there answers like an agent of this venv on the same engine, and ``blink
serve`` says in one line which extra it lacks."""
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from blink.version import __version__

from tests.nic.remote.test_attach_cli import (CLI_ENGINE, accepting, blink, completion_through, free_port, healthy_ring,
                                              interrupted, wait_for)

ROOT = Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agent_venv(tmp_path_factory) -> Path:
    """A fresh venv with ``pip install --no-index --find-links WHEELS blink-serve`` in it; its bin directory."""
    scratch = tmp_path_factory.mktemp("packaging")
    tree, wheels, env = scratch / "tree", scratch / "wheels", scratch / "venv"
    # A copy of what the wheel is built from, so the build leaves nothing in the checkout (build/, *.egg-info).
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run(sys.executable, "-m", "pip", "wheel", "-q", "-w", wheels, tree)
    venv.create(env, with_pip=True)
    run(env / "bin" / "pip", "install", "-q", "--no-index", "--find-links", wheels, PROJECT["name"],
        env=outside_this_tree())        # on PYTHONPATH, a checkout's blink_serve.egg-info would count as installed
    return env / "bin"


def run(*command, **options) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, **options)
    assert done.returncode == 0, f"{command}: {done.stderr[-3000:]}"
    return done


def outside_this_tree() -> dict:
    """The environment without PYTHONPATH: the venv's blink is the installed wheel's, not this checkout's."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_core_install_is_this_project_without_torch_or_numba(agent_venv):
    code = ("import importlib.metadata as m, importlib.resources as r, importlib.util as u, blink; "
            "data = r.files('blink.device').joinpath('shim.cu').is_file() and "
            "r.files('blink.models').joinpath('shapes', 'llama-3-8b', 'config.json').is_file(); "
            "print(m.version('blink-serve'), blink.__file__, data, [n for n in ('torch', 'numba') if u.find_spec(n)])")
    done = run(agent_venv / "python", "-c", code, env=outside_this_tree(), cwd=agent_venv)
    version, where, data, engine_modules = done.stdout.split(maxsplit=3)
    assert version == __version__ and where.startswith(str(agent_venv.parent)), done.stdout
    assert data == "True", "the wheel lacks its package data (shim.cu, the full-size shapes)"
    assert engine_modules.strip() == "[]", done.stdout
    run(agent_venv / "blink", "agent", "--help", env=outside_this_tree())


def test_blink_serve_without_the_engine_extra_names_it_in_one_line(agent_venv):
    from blink.models import default_model_path

    done = subprocess.run([agent_venv / "blink", "serve", "--model", default_model_path(), "--port", "0"],
                          capture_output=True, text=True, timeout=300, env=outside_this_tree())
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("blink serve: the engine needs the engine extra (torch, numba "
                                                    "not installed): pip install 'blink-serve[engine]'"), done.stderr


def test_an_agent_without_torch_answers_like_one_with_it_on_the_same_remote_engine(agent_venv):
    from blink.models import default_model_path

    model_dir = default_model_path()
    ring, listen = f"blink-test-packaging-{os.getpid()}", f"127.0.0.1:{free_port()}"
    engine = blink("engine", str(model_dir), "--ring", ring, "--listen", listen, *CLI_ENGINE)
    try:
        wait_for(lambda: healthy_ring(ring) and accepting(listen), timeout_s=120)
        remote = ["--remote", listen, "--transport", "ipc", "--ring-key", ring]
        here = completion_through(remote, model_dir)
        core_only = completion_through(remote, model_dir, command=(agent_venv / "blink",), env=outside_this_tree())
        assert core_only == here and here
        assert interrupted(engine) == 0
    finally:
        engine.kill()
