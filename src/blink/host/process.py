"""The engine in a process of its own: spawn it on a shared-memory ring, attach to that ring, stop it; and the split
of the host's cores between the engine and the agent (``blink.host.cores`` chooses them, ``blink.host.priority`` the
agent's priority).

``blink serve`` runs the engine here and the HTTP agent in the calling process; ``blink engine`` runs ``serve_ring``
alone. The engine process only sleeps while the GPU schedules itself; it stops, removing its ring, on SIGINT or
SIGTERM, on a shutdown through the ring, or when the process that spawned it dies.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

from blink.config import EngineConfig
from blink.errors import BlinkError, EngineError
from blink.extras import require_engine
from blink.host.priority import reset_priority
from blink.ring import control

log = logging.getLogger("blink")
# Errors that say what was wrong and what to do: shown as one line, without a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, BlinkError)
ATTACH_TIMEOUT_S = 600.0        # loading a large model and capturing its graphs can take minutes


def report_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack on the process's stderr: where one that does not stop waits."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def serve_ring(config: EngineConfig, listen: str | None = None, rdma_device=None, stop_on_sigint: bool = True) -> None:
    """Process entry point (``blink engine``): serve the shared ring ``config.ring_name`` until SIGINT or SIGTERM,
    or until a shutdown is requested through the ring; then stop cleanly (the ring is removed). ``stop_on_sigint``
    False: SIGINT is ignored (``blink serve``'s engine: a terminal's Ctrl-C reaches the whole process group, and the
    agent, draining, still needs its engine; it asks for the shutdown through the ring when the drain ends).

    ``listen`` (``HOST:PORT``): also answer agents on other hosts or DPUs that attach over RDMA or CUDA IPC
    (``blink.nic.remote.attach``: a setup-only listener; ``rdma_device`` an ``ibverbs.DeviceConfig``)."""
    from blink.core import EngineCore
    from blink.ring import secret

    if config.request_side == "device" and listen is None:
        raise ValueError("an engine whose ring's request side is in GPU memory (--request-side device) needs "
                         "--listen HOST:PORT: agents reach that ring only through the engine's listener")
    if listen is not None and config.ring_name is None and secret.given(None) is None:
        raise ValueError(f"an engine whose ring has no name (EngineConfig.ring_name None) publishes no key file, so "
                         f"its listener needs ${secret.ENV}: set it to a long random secret, the same for the engine "
                         "and its agents")
    reset_priority()
    # The signal only sets an event: an exception raised asynchronously inside threading's own waits (is_alive,
    # join) can leave a thread's state lock held, and the shutdown's join would then hang forever.
    stop = threading.Event()
    def stop_serving(*_):
        stop.set()

    signal.signal(signal.SIGTERM, stop_serving)
    signal.signal(signal.SIGINT, stop_serving if stop_on_sigint else signal.SIG_IGN)
    with EngineCore(config) as core, _agent_listener(core, listen, rdma_device):
        # A tick every ALIVE_TICK_S is all the host does while the loop serves: it tells the agent that this
        # process lives (blink.nic.liveness), so a long step is not taken for a dead engine.
        ticks = 0
        while core.alive() and not stop.wait(control.ALIVE_TICK_S):
            ticks += 1
            control.write(core.ring_memory, "alive", ticks)
        error = core.error
    if error is not None:
        # The loop died (the ring says "stopped", so the agent has failed what was in flight and refuses new
        # requests); everything is released: exit non-zero so that a supervisor restarts the server.
        log.error("the engine's scheduler loop failed", exc_info=error)
        raise EngineError(f"the engine's scheduler loop failed ({error!r}): the engine has stopped")
    log.info("stopped")


def _agent_listener(core, listen: str | None, rdma_device):
    """Where remote agents attach to ``core``'s ring (closed before the ring), or nothing; they prove they know the
    ring's secret: the one in its key file, or ``$BLINK_RING_SECRET`` (``serve_ring`` checked there is one)."""
    if listen is None:
        return contextlib.nullcontext()
    from blink.nic.remote.attach import listen_on_ring
    from blink.ring import secret

    return listen_on_ring(listen, core.segments(), core.geometry, ring_secret=secret.given(core.config.ring_name),
                          rdma_device=rdma_device)


@contextmanager
def engine_process(config: EngineConfig):
    """The engine (``serve_ring``) in another process, on the shared-memory ring ``config.ring_name`` it creates.

    Yields ``(memory, process)`` once the ring exists; on exit asks the engine to shut down through the ring, waits
    for the process, and removes the ring if the engine could not.
    """
    from blink.ring import secret
    from blink.ring.transport import SharedMemory

    require_engine("the engine")             # here, in one line, rather than by the engine process as it dies
    sweep_stale_rings()
    process = mp.get_context("spawn").Process(target=_engine_entry, args=(config, os.getpid()), daemon=True)
    process.start()
    memory = None
    try:
        memory = attach_ring(config, process)
        yield memory, process
    finally:
        if memory is not None:
            control.request_shutdown(memory)
            memory.close()
        process.join(60)
        if process.is_alive():
            process.terminate()
            process.join(10)
            process.kill()
        if process.exitcode:
            log.warning("the engine process exited with code %d", process.exitcode)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SharedMemory.SHM_DIR, config.ring_name))
        secret.remove(config.ring_name)


def open_ring(name: str):
    """``blink agent --ring NAME``: the shared-memory ring ``name`` of an engine that runs already, once it is known
    to be this user's (``SharedMemory.open``) and made with the secret this agent was given (``blink.ring.secret``:
    the key file beside it, or ``$BLINK_RING_SECRET``)."""
    from blink.ring import secret
    from blink.ring.transport import SharedMemory

    memory = SharedMemory.open(name)
    try:
        secret.verify(memory, secret.read(name), name)
    except BaseException:
        memory.close()
        raise
    return memory


def sweep_stale_rings() -> None:
    """Remove the rings (and their key files) that killed servers of this user left in ``/dev/shm``: named as
    ``blink serve`` names them (``blink-PID-...``), this user's, initialised, and held by no engine (no lock on their
    ``CREATOR_BYTE``: the lock goes with its process however it ends, in whatever pid namespace it ran)."""
    from blink.ring import secret
    from blink.ring.transport import CREATOR_BYTE, SharedMemory, check_owned, lock_bytes

    for entry in os.scandir(SharedMemory.SHM_DIR):
        if not entry.name.startswith("blink-") or entry.name.endswith(secret.SUFFIX):
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue                # another user's, or gone meanwhile
        try:
            check_owned(fd, entry.path)
            identity = (control.MAGIC | control.VERSION << 32).to_bytes(8, "little")
            if os.pread(fd, 8, 0) != identity or not lock_bytes(fd, CREATOR_BYTE):
                continue            # not a ring of this blink (whose engines hold the lock), not made yet, or live
            os.unlink(entry.path)
            secret.remove(entry.name)
            log.info("removed %s, the ring of a blink server that is gone", entry.path)
        except (BlinkError, OSError):
            continue
        finally:
            os.close(fd)


def _engine_entry(config: EngineConfig, parent: int) -> None:
    """``engine_process``'s target: the engine until shutdown, a start-up error reported in one line."""
    logging.basicConfig(level=logging.INFO, format="blink: %(message)s")
    report_stacks_on_sigusr1()
    stop_with_parent(parent)
    try:
        serve_ring(config, stop_on_sigint=False)
    except USER_ERRORS as e:
        print(f"blink engine: {e}", file=sys.stderr)
        sys.exit(1)


def stop_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies (Linux), so a killed ``blink serve`` leaves no engine behind;
    ``serve_ring`` turns SIGTERM into a clean stop that removes the ring."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:      # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def attach_ring(config: EngineConfig, process, timeout_s: float = ATTACH_TIMEOUT_S):
    """Open the ring the engine ``process`` creates: once it exists, has its full size and its control block, and
    that block names ``process`` as its creator (a ring some other or killed engine left under the name is never
    attached to)."""
    from blink.ring.transport import SharedMemory

    deadline = time.monotonic() + timeout_s
    while True:
        memory = _open_initialised(config.ring_name, process.pid)
        if memory is not None:
            return memory
        if not process.is_alive():
            raise EngineError(f"the engine process exited (code {process.exitcode}) before it created its ring")
        if time.monotonic() > deadline:
            raise EngineError(f"the engine did not create its ring {SharedMemory.SHM_DIR}/{config.ring_name} "
                              f"within {timeout_s:.0f} s")
        time.sleep(0.05)


def _open_initialised(name: str, creator_pid: int):
    """The shared-memory ring ``name`` once process ``creator_pid`` has written its control block, else None."""
    from blink.ring.transport import SharedMemory

    try:
        memory = SharedMemory.open(name)
    except (FileNotFoundError, ValueError):
        return None         # not created yet, or not yet sized
    raw = memory.read(0, control.CONTROL_DTYPE.itemsize)
    try:
        control.geometry_of(raw)
        mine = control.decode(raw)["creator_pid"] == creator_pid
    except (BlinkError, ValueError):
        mine = False        # sized, but its control block is not written yet
    if not mine:
        memory.close()
        return None
    return memory


def wait_until_serving(agent, engine=None, timeout_s: float = ATTACH_TIMEOUT_S) -> None:
    """Block until the ring's engine reports it is serving; ``EngineError`` saying why if it does not."""
    deadline = time.monotonic() + timeout_s
    while agent.stats()["engine_state"] == control.ENGINE_STARTING:
        if engine is not None and not engine.is_alive():
            raise EngineError(f"the engine process exited (code {engine.exitcode}) before it started serving")
        if time.monotonic() > deadline:
            raise EngineError(f"the engine did not start serving within {timeout_s:.0f} s: is it running on this "
                              "ring?")
        time.sleep(0.01)


def engine_gone(agent, process=None) -> str | None:
    """Why the engine behind ``agent``'s ring is gone for good, or None: its process (when this process spawned
    it) exited, or it stopped, or its process stopped ticking (``blink.nic.liveness``)."""
    if process is not None and not process.is_alive():
        process.join(0)                     # reap it: no zombie is left while the agent shuts down
        code = "" if process.exitcode is None else f" (code {process.exitcode})"     # None: not this one's child
        return f"the engine process exited{code}"
    stats = agent.stats()
    if stats["engine_state"] == control.ENGINE_STOPPED:
        return "the engine has stopped"
    now = time.monotonic()
    problem = agent.liveness.problem(stats, now)
    return problem if agent.liveness.process_gone(now) else None


def engine_watch(agent, process=None, start_timeout_s: float = ATTACH_TIMEOUT_S):
    """``engine_gone`` for a server that listens while its engine starts (its readiness says "starting"): a function
    saying why the engine is gone for good, or None; an engine that has not begun to serve ``start_timeout_s``
    after this call counts as gone, as in ``wait_until_serving``."""
    deadline = time.monotonic() + start_timeout_s

    def gone() -> str | None:
        if agent.stats()["engine_state"] == control.ENGINE_STARTING and time.monotonic() > deadline:
            return f"the engine did not start serving within {start_timeout_s:g} s"
        return engine_gone(agent, process)

    return gone


def pin_threads(pid: int, cores) -> None:
    """Pin every thread of process ``pid`` to ``cores``. ``sched_setaffinity(pid)`` pins one thread, the process's
    first; the threads the process had started by then keep their cores (the engine's: torch's and numba's, one of
    them running matmuls on the agent's core) and a new thread takes its creator's. So each thread is pinned, again
    until a listing of ``/proc/PID/task`` shows none unpinned (a thread started meanwhile by one not yet pinned)."""
    pinned: set[int] = set()
    while tids := {int(tid) for tid in os.listdir(f"/proc/{pid}/task")} - pinned:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):      # a thread that has ended
                os.sched_setaffinity(tid, cores)
        pinned |= tids


@contextmanager
def split_cores(process, agent_cores: list[int] | None, reserve: bool = False, agents: int = 1):
    """Yields the agent's cores (``blink.host.cores.place``: ``agent_cores`` if given, else the least busy core this
    process may use that no other blink server claims, one per agent process up to ``agents``) and pins the engine
    ``process`` (if not None) to the others, so HTTP and tokenization never compete with the engine; None on an OS
    without affinity. With ``reserve`` this process moves into a cpuset partition of those cores, which no other
    process on the host may use (``blink.host.partition``; refused, it says why and goes on without). The agent's
    claim on its cores, and the partition, last until the block is left."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    from blink.host.cores import place
    from blink.host.partition import reserved_cores

    with place(agent_cores, with_engine=process is not None, count=agents) as placement:
        if process is not None and placement.engine:
            try:
                pin_threads(process.pid, placement.engine)
            except OSError as e:                # the engine may have exited already: the agent reports that
                log.warning("could not pin the engine process to cores %s: %s", list(placement.engine), e)
        whole = len(placement.agent) == len(placement.allowed)
        if reserve and whole:
            log.warning("--reserve-agent-cores: the agent's cores are all this process may use; not reserved")
        with reserved_cores(placement.agent) if reserve and not whole else contextlib.nullcontext():
            yield list(placement.agent)
