"""Counts the stores of one ``LocalMemory.write`` under gdb (a hardware access watchpoint on the word): run by
tests/ring/test_transport.py as ``gdb -batch -x word_stores.py --args python word_stores.py NBYTES``.

Without gdb's ``gdb`` module (run by Python), it is the program gdb runs: it writes the word's address to the file
``$BLINK_WORD_FILE``,
stops itself (SIGTRAP: gdb sets its watchpoint), writes ``NBYTES`` at that address, and stops again (gdb counts).
Under gdb, it drives that program and prints ``stores: N``.
"""
import os
import signal
import sys

try:
    import gdb
except ImportError:
    gdb = None


def program(nbytes: int) -> None:
    import ctypes

    from blink.ring.transport import LocalMemory

    memory = LocalMemory(64)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory.buffer)) + 8
    with open(os.environ["BLINK_WORD_FILE"], "w") as f:
        f.write(str(address))
    data = bytes(range(1, nbytes + 1))
    os.kill(os.getpid(), signal.SIGTRAP)
    memory.write(8, data)
    os.kill(os.getpid(), signal.SIGTRAP)


def count_stores() -> None:
    gdb.execute("set pagination off")
    gdb.execute("handle SIGTRAP stop nopass")
    gdb.execute("run", to_string=True)
    with open(os.environ["BLINK_WORD_FILE"]) as f:
        address = int(f.read())
    gdb.execute(f"awatch *(int *) {address}")
    stops = []
    gdb.events.stop.connect(lambda event: stops.append(isinstance(event, gdb.BreakpointEvent)))
    gdb.events.exited.connect(lambda event: stops.append(False))
    while True:
        gdb.execute("continue", to_string=True)
        if not stops[-1]:           # the second SIGTRAP (or an exit): the write is over
            break
    print(f"stores: {sum(stops)}")


if gdb is not None:
    count_stores()
else:
    program(int(sys.argv[1]))
