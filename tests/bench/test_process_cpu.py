"""blink.bench.process_cpu: a server's CPU time as its processes spend it, against what the processes themselves
report (``os.times``), a process outside the tree not counted."""
import subprocess
import sys

import pytest

from blink.bench.process_cpu import tree_cpu_seconds

# Burns CPU until its own user + system time reaches argv[1] seconds, prints that time, waits for stdin to close.
BURN = ("import os, sys\n"
        "while sum(os.times()[:2]) < float(sys.argv[1]): pass\n"
        "print(sum(os.times()[:2]), flush=True)\n"
        "sys.stdin.read()\n")
# A parent that starts a burner as its child and relays its line: the burner is in the parent's tree, not its own.
PARENT = ("import subprocess, sys\n"
          "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,\n"
          "                         text=True)\n"
          "print(child.stdout.readline().strip(), flush=True)\n"
          "sys.stdin.read(); child.kill(); child.wait()\n")


def _start(*args):
    return subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_tree_counts_its_descendants_and_not_other_processes():
    server = _start(PARENT, BURN, "0.6")
    neighbour = _start(BURN, "1.2")             # as busy, but not under the server
    try:
        child_cpu = float(server.stdout.readline())
        neighbour.stdout.readline()
        total = tree_cpu_seconds(server.pid)
        own = tree_cpu_seconds(neighbour.pid)
    finally:
        for p in (server, neighbour):
            p.stdin.close()
            p.wait(timeout=30)
    # The child's burn is in the server's tree (to a clock tick); the parent adds its interpreter's start, well
    # under the neighbour's 1.2 s, which would be there if the tree took in processes not under it.
    assert child_cpu - 0.02 <= total < child_cpu + 1.0
    assert own >= 1.2 - 0.02


def test_a_process_that_is_not_running_is_named():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with pytest.raises(ValueError, match="--server-pid names the server's process"):
        tree_cpu_seconds(int(done.stdout))
