"""What must hold whenever nothing is in flight (SGLang's "memory leak detected" check, for blink's pool and ring),
judged by the agent from the ring's control block and its own slot count:

- the engine runs and queues nothing (``running`` = ``waiting`` = 0) and, where one agent serves the ring (its
  ``submitted`` doorbell counts its requests: ``blink.ring.shares``), has finished everything submitted
  (``finished`` = ``submitted``: a refused request is published as finished);
- every KV page is free or an evictable prefix-cache page (``kv_pages_free`` counts both) = the pool
  (``kv_pages_total``): no page leaked;
- the agent holds none of its ``n_slots`` slots (all free).

Where several agents serve the ring, "nothing in flight" is the whole ring's: the agent checks only while every
slot of the ring is FREE (``Agent.others_busy``).

The control block is not read atomically with the engine's writes, and its gauges are published at the end of an
iteration: a violation counts only once it has held in two idle snapshots two or more engine iterations apart
(``heartbeat``) with nothing submitted in between. It is then reported once (``check`` returns it) until it clears.
"""
from __future__ import annotations


def idle_violations(stats, free_slots: int, n_slots: int, counted: bool = True) -> set[str]:
    """Which idle invariants the control-block snapshot ``stats`` and the agent's ``free_slots`` (of its
    ``n_slots``) break; ``counted``: the ring's ``submitted`` doorbell counts requests (one agent serves it)."""
    broken = set()
    if stats["running"] or stats["waiting"]:
        broken.add(f"the engine reports {stats['running']} requests running and {stats['waiting']} waiting")
    if counted and stats["finished"] != stats["submitted"]:
        broken.add(f"the engine finished {stats['finished']} of {stats['submitted']} submitted requests")
    if stats["kv_pages_free"] != stats["kv_pages_total"]:
        broken.add(f"{stats['kv_pages_total'] - stats['kv_pages_free']} of {stats['kv_pages_total']} KV pages are "
                   "neither free nor evictable")
    if free_slots != n_slots:
        broken.add(f"the agent holds {n_slots - free_slots} of its {n_slots} ring slots")
    return broken


class IdleInvariants:
    """Folds idle snapshots into the violations to report, each once (see the module docstring)."""

    def __init__(self, n_slots: int, counted: bool = True):
        self.n_slots, self.counted = n_slots, counted
        self._first: tuple[int, int, set[str]] | None = None     # (heartbeat, submitted, broken) first seen idle
        self._reported: set[str] = set()

    def check(self, stats, free_slots: int) -> set[str]:
        """Call with each snapshot taken while nothing is in flight; returns the violations newly confirmed."""
        broken = idle_violations(stats, free_slots, self.n_slots, self.counted)
        heartbeat, submitted = int(stats["heartbeat"]), int(stats["submitted"])
        if self._first is None or self._first[1] != submitted:
            self._first = (heartbeat, submitted, broken)
            return set()
        if heartbeat < self._first[0] + 2:
            return set()
        held = broken & self._first[2]
        self._first = (heartbeat, submitted, broken)
        new, self._reported = held - self._reported, held | (self._reported & broken)
        return new

    def busy(self) -> None:
        """Something is in flight: the next idle snapshot starts a new judgement."""
        self._first = None
