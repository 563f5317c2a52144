"""Python in a fresh process with numba's CUDA simulator on or off (numba reads the choice once per process)."""
import os
import subprocess
import sys
import textwrap
import time

REPO_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def start_python(code: str, simulator: bool) -> subprocess.Popen:
    """``python -c code`` started, not waited for (``finish``)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1" if simulator else "0",
           "PYTHONPATH": os.path.abspath(REPO_SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, cpu_limit_s: float = 600, wall_limit_s: float = 7200) -> str:
    """The stdout of a ``start_python`` process, which must exit 0 having used at most ``cpu_limit_s`` seconds of
    CPU. The limit is on its work, not on the wait: on a loaded host (a 2-core CI box shared with other jobs, and
    both image links of tests/device/test_image.py at once) it may wait for a core far longer than it runs, and a
    wall-clock limit failed a link that was progressing. ``wall_limit_s`` only stops a process that never ends."""
    started = time.monotonic()
    try:
        while True:
            try:
                stdout, stderr = process.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                used = cpu_seconds(process.pid)
                assert used <= cpu_limit_s, f"the process used {used:.0f} s of CPU, more than {cpu_limit_s:.0f} s"
                assert time.monotonic() - started <= wall_limit_s, f"the process ran past {wall_limit_s:.0f} s"
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    return stdout


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux's /proc/PID/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_python(code: str, simulator: bool, cpu_limit_s: float = 600) -> str:
    return finish(start_python(code, simulator), cpu_limit_s)
