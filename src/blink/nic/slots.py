"""Slot tracker: which request slots the agent may fill next, without asking the GPU side per request.

The tracker keeps a local availability cache, one byte per slot (1 = free). A slot becomes unavailable when the
agent claims it and available again only when the agent releases it — which the agent does after the GPU side
marked it FINISHED and every token was delivered — or when a refresh sees it FREE in the ring and the tracker does
not hold it. So a slot is never handed to two requests and never reused before the GPU side has finished with it.

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
    """Availability cache for ``n_slots`` slots. Not thread-safe: one agent drives it."""

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError(f"SlotTracker n_slots must be >= 1 (got {n_slots})")
        self.n_slots = n_slots
        self._free = bytearray(_FREE * n_slots)
        self._held = bytearray(n_slots)      # 1 = claimed by this agent and not yet released
        self._hint = 0
        self.n_free = n_slots
        self.probes = 0                       # slots skipped by the scan, for the amortised-cost bound

    def claim(self) -> int:
        """Return a free slot and mark it held, or raise ``RingFull``."""
        if self.n_free == 0:
            raise RingFull(f"all {self.n_slots} request slots are in use; poll() to release finished requests")
        slot = self._free.find(_FREE, self._hint)
        if slot < 0:
            slot = self._free.find(_FREE, 0, self._hint)
        self.probes += (slot - self._hint) % self.n_slots
        self._free[slot] = 0
        self._held[slot] = 1
        self.n_free -= 1
        self._hint = (slot + 1) % self.n_slots
        return slot

    def release(self, slot: int) -> None:
        """Give back a held slot (the agent has written it FREE)."""
        if not self._held[slot]:
            raise ValueError(f"slot {slot} is not held by this tracker; it cannot be released")
        self._held[slot] = 0
        self._free[slot] = 1
        self.n_free += 1

    def refresh(self, states: np.ndarray) -> None:
        """Rebuild the cache from one bulk read of every slot's state word: free = FREE in the ring and not held.

        Catches slots that another writer (a previous agent run, a recovery tool) left non-FREE, and slots that
        became FREE in the ring without passing through this tracker.
        """
        if states.shape != (self.n_slots,):
            raise ValueError(f"refresh needs {self.n_slots} state words, got shape {states.shape}")
        held = np.frombuffer(self._held, np.uint8)
        free = (states == FREE) & (held == 0)
        self._free[:] = free.astype(np.uint8).tobytes()
        self.n_free = int(free.sum())

    def is_held(self, slot: int) -> bool:
        return bool(self._held[slot])
