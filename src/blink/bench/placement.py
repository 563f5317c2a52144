"""Where a benchmark's processes run under ``--interference``: the layouts a server on a shared host meets.

- ``shared`` (the default): hogs on every core, the client at normal priority beside the server;
- the same with ``--client-priority high``: the client stands for one on another host, which the hogs cannot slow;
- ``--reserve-cpus LIST``: the hogs never touch LIST, where the server runs (``taskset -c LIST blink serve ...``,
  a DPU's cores or a reserved cpuset stand-in) and the client too, unless ``--client-cpus`` puts it elsewhere.

Hogs are pinned round-robin over their cores (``interference``); ``--client-cpus`` pins this process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from blink.host.cores import cpu_list
from blink.host.process import pin_threads


@dataclass(frozen=True)
class Layout:
    """``allowed``: the cores this process may use; ``hog_cpus``: where the hogs run; ``client_cpus``: where this
    process (the client; with ``--backend hf`` the peer's model too) is pinned, or None. Invariants: both are
    non-empty subsets of ``allowed``; with ``reserved``, the hogs keep off it."""

    allowed: tuple[int, ...]
    hog_cpus: tuple[int, ...]
    client_cpus: tuple[int, ...] | None
    reserved: tuple[int, ...] = ()

    def __post_init__(self):
        for option, cores in (("--client-cpus", self.client_cpus), ("--reserve-cpus", self.reserved)):
            if cores and not set(cores) <= set(self.allowed):
                raise ValueError(f"{option} {cpu_list(cores)}: this process may only use cores "
                                 f"{cpu_list(self.allowed)} (its affinity: the cgroup's cpuset, taskset)")
        if not self.hog_cpus:
            raise ValueError(f"--reserve-cpus {cpu_list(self.reserved)} leaves none of the cores "
                             f"{cpu_list(self.allowed)} for the hogs: reserve fewer")
        if set(self.hog_cpus) & set(self.reserved):
            raise ValueError("the hogs may not run on the reserved cores")

    @property
    def name(self) -> str:
        return "reserved" if self.reserved else "shared"

    def describe(self) -> str:
        """One line: where hogs, client (and the server, for the reserved layout) run."""
        where = f"hogs on cores {cpu_list(self.hog_cpus)}"
        if self.reserved:
            where += f", cores {cpu_list(self.reserved)} kept from them (a server's: taskset -c " \
                     f"{cpu_list(self.reserved)} blink serve ...; or a client's alone, as if on another host)"
        client = f"cores {cpu_list(self.client_cpus)}" if self.client_cpus else "any core"
        return f"layout {self.name}: {where}; client on {client}"

    def as_json(self) -> dict:
        return {"name": self.name, "hog_cpus": list(self.hog_cpus), "reserved": list(self.reserved),
                "client_cpus": None if self.client_cpus is None else list(self.client_cpus)}


def layout(reserve_cpus: list[int] | None, client_cpus: list[int] | None) -> Layout:
    """The layout of ``--reserve-cpus`` and ``--client-cpus`` on the cores this process may use."""
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    reserved = tuple(sorted(reserve_cpus or ()))
    client = tuple(sorted(client_cpus)) if client_cpus else reserved or None
    return Layout(allowed, tuple(c for c in allowed if c not in reserved), client, reserved)


def pin_client(placed: Layout) -> None:
    """Pin this process, each of its threads, where ``placed`` says (before the hogs start: they are pinned on their
    own). The threads started at import (numpy's) are this process's too."""
    if placed.client_cpus:
        pin_threads(os.getpid(), placed.client_cpus)
