"""Python in a fresh process with numba's CUDA simulator on or off (numba reads the choice once per process)."""
import os
import subprocess
import sys
import textwrap

REPO_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def start_python(code: str, simulator: bool) -> subprocess.Popen:
    """``python -c code`` started, not waited for (``finish``)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1" if simulator else "0",
           "PYTHONPATH": os.path.abspath(REPO_SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: int = 600) -> str:
    """The stdout of a ``start_python`` process, which must exit 0 within ``timeout`` seconds."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    return stdout


def run_python(code: str, simulator: bool, timeout: int = 600) -> str:
    return finish(start_python(code, simulator), timeout)
