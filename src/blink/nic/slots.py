"""Slot tracker: which request slots the agent may fill next, without asking the GPU side per request.

The tracker keeps a local availability cache, one byte per slot of its range (1 = free): all the ring's slots, or
the agent's share of them when several agents serve one ring (``blink.ring.shares``). A slot becomes unavailable
when the agent claims it and available again only when the agent releases it — which the agent does after the GPU
side marked it FINISHED and every token was delivered — or when a refresh sees it FREE in the ring and the tracker
does not hold it. So a slot is never handed to two requests and never reused before the GPU side has finished with it.

Finding a free slot is a circular scan starting at a hint just past the last claimed slot. Requests mostly finish in
the order they arrive, so the slot at the hint is usually the oldest one and already free: the amortised scan is
O(1). The scan itself is ``bytearray.find`` (memchr), so even a long skip costs two C calls, not a Python loop.
"""
from __future__ import annotations

import numpy as np

from blink.errors import RingFull
from blink.ring.layout import FREE

_FREE = b"\x01"


class SlotTracker:
    """Availability cache for the slots ``slots`` (default: all) of a ring of ``n_slots``: the agent's own range when
    several agents share the ring (``blink.ring.shares``); it never hands out a slot outside it. Not thread-safe: one
    agent drives it."""

    def __init__(self, n_slots: int, slots: range | None = None):
        slots = range(n_slots) if slots is None else slots
        if not (len(slots) >= 1 and slots.step == 1 and 0 <= slots.start and slots.stop <= n_slots):
            raise ValueError(f"SlotTracker slots must be a non-empty range of consecutive slots of the ring's "
                             f"{n_slots} (got {slots!r})")
        self.ring_slots, self.slots, self.n_slots = n_slots, slots, len(slots)
        self._first = slots.start
        self._free = bytearray(_FREE * self.n_slots)    # by slot - first
        self._held = bytearray(self.n_slots)            # 1 = claimed by this agent and not yet released
        self._hint = 0
        self.n_free = self.n_slots
        self.probes = 0                       # slots skipped by the scan, for the amortised-cost bound

    def claim(self) -> int:
        """Return a free slot and mark it held, or raise ``RingFull``."""
        if self.n_free == 0:
            raise RingFull(f"all {self.n_slots} request slots are in use; poll() to release finished requests")
        local = self._free.find(_FREE, self._hint)
        if local < 0:
            local = self._free.find(_FREE, 0, self._hint)
        self.probes += (local - self._hint) % self.n_slots
        self._hint = (local + 1) % self.n_slots
        self._take(local)
        return self._first + local

    def hold(self, slot: int) -> None:
        """Mark ``slot``, which the ring shows in use, held: the agent has taken over its request (an agent of its
        range that died left it), and releases it like one it claimed."""
        local = self._local(slot)
        if self._held[local]:
            raise ValueError(f"slot {slot} is held by this tracker already")
        self._take(local)

    def release(self, slot: int) -> None:
        """Give back a held slot (the agent has written it FREE)."""
        local = self._local(slot)
        if not self._held[local]:
            raise ValueError(f"slot {slot} is not held by this tracker; it cannot be released")
        self._held[local] = 0
        self._free[local] = 1
        self.n_free += 1

    def refresh(self, states: np.ndarray) -> None:
        """Rebuild the cache from one bulk read of every slot's state word: free = FREE in the ring and not held.

        Catches slots that another writer (a previous agent run, a recovery tool) left non-FREE, and slots that
        became FREE in the ring without passing through this tracker.
        """
        if states.shape != (self.ring_slots,):
            raise ValueError(f"refresh needs {self.ring_slots} state words, got shape {states.shape}")
        held = np.frombuffer(self._held, np.uint8)
        free = (states[self.slots.start:self.slots.stop] == FREE) & (held == 0)
        self._free[:] = free.astype(np.uint8).tobytes()
        self.n_free = int(free.sum())

    def is_held(self, slot: int) -> bool:
        return bool(self._held[self._local(slot)])

    def _take(self, local: int) -> None:
        self.n_free -= self._free[local]
        self._free[local] = 0
        self._held[local] = 1

    def _local(self, slot: int) -> int:
        if slot not in self.slots:
            raise ValueError(f"slot {slot} is not among this tracker's slots {self.slots.start}-{self.slots.stop - 1}")
        return slot - self._first
