"""Python in a fresh process with numba's CUDA simulator on or off (numba reads the choice once per process)."""
import os
import subprocess
import sys
import textwrap

REPO_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def run_python(code: str, simulator: bool, timeout: int = 600) -> str:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1" if simulator else "0",
           "PYTHONPATH": os.path.abspath(REPO_SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout

