"""CPU and memory interference: ``n`` processes that keep host cores and memory bandwidth busy.

Even-numbered hogs copy 64 MiB numpy arrays back and forth (memory bandwidth, the protocol of DESIGN.md section 6);
odd-numbered ones zlib-compress 16 MiB of random bytes (integer CPU work with a cache-sized window). Each hog is a
``python -c`` process that asks the kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``), so none outlives
a benchmark that is killed; a normal or failing exit of ``interference`` kills and reaps them all. Hogs are pinned
round-robin to their cores (every core this process may use, unless told), so each carries ``n / cores`` of them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

# Dies with its parent: prctl(PR_SET_PDEATHSIG, SIGKILL), and exits if the parent is already gone. Runs at nice 0
# where its parent raised its own priority (``blink bench serve --client-priority``): a neighbour, not the client
# (a parent at a nice above 0 is left alone: lowering a nice value needs privilege).
_GUARD = ("import ctypes, os, signal, sys\n"
          "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
          "if os.getppid() != {parent}: sys.exit(0)\n"
          "if os.getpriority(os.PRIO_PROCESS, 0) < 0: os.setpriority(os.PRIO_PROCESS, 0, 0)\n")
MEMORY_COPY = ("import numpy as np\n"
               "a = np.ones(8 << 20); b = np.empty_like(a)\n"
               "while True: np.copyto(b, a); np.copyto(a, b)\n")
COMPRESSION = ("import os, zlib\n"
               "data = os.urandom(16 << 20)\n"
               "while True: zlib.compress(data, 6)\n")


# What the hogs do (``blink bench serve --hog-kind``): both kinds, half each (the default), or one kind alone, to tell
# what a neighbour takes from the server: memory bandwidth (copies) or CPU time with little memory traffic.
HOG_KINDS = {"mixed": (MEMORY_COPY, COMPRESSION), "memory": (MEMORY_COPY,), "cpu": (COMPRESSION,)}


def hog_command(i: int, parent: int, programs: tuple[str, ...] = HOG_KINDS["mixed"]) -> list[str]:
    """The command line of hog ``i``: ``programs[i % len(programs)]`` (by default memory copy for even ``i``,
    compression for odd)."""
    return [sys.executable, "-c", _GUARD.format(parent=parent) + programs[i % len(programs)]]


@contextmanager
def interference(n: int, programs: tuple[str, ...] = HOG_KINDS["mixed"], cpus=None):
    """Run ``n`` hogs for the duration of the ``with`` block, hog ``i`` pinned to core ``cpus[i % len(cpus)]``
    (``cpus`` None: every core this process may use); yields their ``Popen`` objects (``n == 0``: none).

    Invariant: when the block is left, by any exit, every hog has been killed and waited for.
    """
    if n < 0:
        raise ValueError(f"--interference must be >= 0 processes (got {n})")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    hogs = []
    try:
        for i in range(n):
            hogs.append(subprocess.Popen(hog_command(i, os.getpid(), programs), stdin=subprocess.DEVNULL))
            os.sched_setaffinity(hogs[-1].pid, {cpus[i % len(cpus)]})
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
