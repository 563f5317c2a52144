"""``blink serve --agent-processes N``: N agent processes serve one ring, each its ``Share`` of it
(``blink.ring.shares``), beside the engine process; this process supervises them (``supervise``).

- An agent process is spawned in a session of its own (a terminal's Ctrl-C reaches this process, which forwards it)
  and stops when this one dies (the parent-death signal, SIGTERM: it drains). It runs ``target(share, listening)``:
  it attaches to its share of the ring (``reopen_ring``), watches the engine process (``Sibling``), listens on the
  server's one port beside the others (SO_REUSEPORT: the kernel spreads the connections) and calls ``listening()``.
- SIGTERM or SIGINT here is forwarded to every agent process as SIGTERM: each drains, and a second signal stops each
  at once. Once all have exited ``supervise`` returns, and the caller shuts the engine down.
- An agent process that dies after it listened is started again on its share (``Share.restarts`` + 1): its
  clients' connections dropped with it (how HTTP reports the end of their requests), its successor finishes what it
  left in the ring (``Agent.take_over``), the others serve on meanwhile. One that exits before it listened could not
  start (a port taken, a ring refused): the server stops, exit code 1, rather than start it again for ever.
- When the engine process exits every agent process sees it (its own watch), fails its requests in flight and exits
  with code 1; none is restarted and the exit code is 1, for a supervisor to restart the whole server.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from blink.errors import RingRefused
from blink.host.process import USER_ERRORS, report_stacks_on_sigusr1, stop_with_parent
from blink.ring import control
from blink.ring.shares import Share

log = logging.getLogger("blink")
CORES_PER_AGENT_PROCESS = 8     # the default: one agent process per this many cores serve may use (the rest: engine)
MAX_DEFAULT_AGENT_PROCESSES = 8


def default_agent_processes(cores: int, n_slots: int) -> int:
    """``blink serve``'s number of agent processes when ``--agent-processes`` is not given: one per
    ``CORES_PER_AGENT_PROCESS`` of the ``cores`` it may use, at least 1, at most ``MAX_DEFAULT_AGENT_PROCESSES`` and
    ``n_slots`` (every process needs a slot). A small host keeps one process: on two cores a second one beside the
    engine served fewer tokens than one alone (docs/serving.md)."""
    return max(1, min(cores // CORES_PER_AGENT_PROCESS, MAX_DEFAULT_AGENT_PROCESSES, n_slots))


@dataclass
class _Running:
    share: Share
    process: mp.process.BaseProcess
    listening: Connection       # this end hears once the agent process listens
    listened: bool = False


def supervise(target, agents: int, engine, exited=lambda pid: None) -> int:
    """Run ``target(share, listening)`` in agent processes ``0 .. agents - 1`` beside ``engine`` (its process, as
    ``engine_process`` yields it) until a signal has stopped them all, one could not start, or the engine exited; the
    exit code (0, or 1: the engine exited or an agent process could not start). ``exited(pid)``: an agent process
    is gone (its live metrics with it)."""
    ctx = mp.get_context("spawn")
    running: dict[int, _Running] = {}
    signals = {"count": 0}
    code = 0

    def start(share: Share) -> None:
        listening, tell = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_agent_entry, args=(target, share, tell, os.getpid()),
                              name=f"blink-agent-{share.index}")
        process.start()
        tell.close()
        running[share.index] = _Running(share, process, listening)
        if signals["count"]:            # a signal came while it was being started: it stops too
            _signal(process.pid, signal.SIGTERM)
        log.info("agent process %d of %d: pid %d%s", share.index, agents, process.pid,
                 f" (restart {share.restarts})" if share.restarts else "")

    def forward(signum, frame) -> None:
        signals["count"] += 1
        for agent in running.values():
            _signal(agent.process.pid, signal.SIGTERM)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(agents):
            start(Share(index, agents))
        while running:
            hearing = [agent.listening for agent in running.values() if not agent.listened]
            ready = set(wait([agent.process.sentinel for agent in running.values()] + hearing, timeout=1.0))
            for agent in [agent for agent in running.values() if agent.listening in ready]:
                agent.listened = _heard(agent.listening)
            for agent in [agent for agent in running.values() if agent.process.sentinel in ready]:
                code = max(code, _gone(agent, running, engine, signals["count"], start, exited, forward))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 1 if not engine.is_alive() else code


def _gone(agent: _Running, running: dict, engine, stopping: int, start, exited, stop_all) -> int:
    """Agent process ``agent`` has exited: restart it, or not; the exit code that makes the server's."""
    agent.process.join()
    del running[agent.share.index]
    exited(agent.process.pid)
    listened = agent.listened or (agent.listening.poll() and _heard(agent.listening))
    agent.listening.close()
    share, exitcode = agent.share, agent.process.exitcode
    if stopping or not engine.is_alive():
        return 0
    if not listened:
        log.error("agent process %d of %d exited (code %s) before it listened: stopping the server", share.index,
                  share.agents, exitcode)
        stop_all(None, None)
        return 1
    log.warning("agent process %d of %d (pid %d) exited (code %s): starting it again; its slots come back, the other "
                "agent processes serve on", share.index, share.agents, agent.process.pid, exitcode)
    start(Share(share.index, share.agents, share.restarts + 1))
    return 0


def _heard(listening: Connection) -> bool:
    """Whether the agent process at the other end said it listens (False: it exited first)."""
    try:
        return bool(listening.recv())
    except EOFError:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass        # it exited meanwhile; its sentinel says so


def _agent_entry(target, share: Share, tell: Connection, parent: int) -> None:
    """An agent process: ``target(share, listening)``, its exit code this process's; a start-up error in one line."""
    os.setsid()
    logging.basicConfig(level=logging.INFO, format=f"blink: [agent {share.index}] %(message)s")
    report_stacks_on_sigusr1()
    stop_with_parent(parent)
    try:
        code = target(share, lambda: tell.send(True))
    except USER_ERRORS as e:
        print(f"blink serve: agent process {share.index}: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)


def reopen_ring(name: str, prefix_seed: int):
    """The shared-memory ring ``name`` that the supervising process attached to, opened again by an agent process:
    its user's with mode 0600 (``SharedMemory.open``) and that very ring (the random prefix-key seed its creator
    drew is ``prefix_seed``), not one made under its name since."""
    from blink.ring.transport import SharedMemory

    memory = SharedMemory.open(name)
    if int(control.decode(memory.read(0, control.CONTROL_DTYPE.itemsize))["prefix_seed"]) != prefix_seed:
        memory.close()
        raise RingRefused(f"the ring {name!r} is not the one this server's engine made: not attached")
    return memory


class Sibling:
    """A process that this one did not start (the engine, for an agent process), watched through its pidfd, as
    ``host.process.engine_gone`` watches a child: ``is_alive`` until it exits (its exit code is its parent's)."""

    exitcode = None

    def __init__(self, pid: int):
        self.pid = pid
        self._fd = os.pidfd_open(pid)

    def is_alive(self) -> bool:
        return not select.select([self._fd], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        """Only a parent reaps a process; nothing to wait for here."""
