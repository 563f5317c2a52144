"""The agent's bookkeeping of the ring's ``grammars`` region: which compiled grammars are placed where.

A grammar is written once and stays while any request uses it, and after, until its room is needed: placed grammars
form an LRU, and placing a new one evicts the least recently used grammars no request in flight uses until a free
run of words holds it (first fit; neighbouring free runs merge). The GPU side reads a grammar only for requests in
flight, so a grammar no request uses may be overwritten. Invariants: placed grammars and free runs tile the region
without overlap (the table's words: the whole region, or one agent's part of it); a grammar with users is never
evicted.
"""
from __future__ import annotations

import bisect
import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from blink.ring.errors import RequestError, RingFull
from blink.ring.geometry import RingGeometry
from blink.ring.grammar import Grammar


@dataclass
class Placement:
    base: int       # the grammar's first word in the region
    size: int       # its words
    users: int      # requests in flight that follow it


class GrammarTable:
    """Places grammars in the words ``words`` (default: all) of the grammars region of a ring of ``geometry``
    through ``write(word, data)``: the agent's part of it when several agents serve one ring
    (``blink.ring.shares``); it never writes outside it."""

    def __init__(self, geometry: RingGeometry, write, words: range | None = None):
        self.geometry, self._write = geometry, write
        self.words = range(geometry.max_grammar_bytes // 4) if words is None else words
        self._placed: OrderedDict[tuple[str, str], Placement] = OrderedDict()
        # (first word, words), by first word
        self._free: list[tuple[int, int]] = [(self.words.start, len(self.words))] if self.words else []
        # Placement ids from a random start: the GPU's mirror of the region keeps a placement while its id matches,
        # so no id may repeat at a word, not even one an earlier agent of the same part of the region placed there.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    def check(self, grammar: Grammar) -> None:
        """``RequestError`` naming ``grammar`` unless the region could ever hold it, for this ring's model."""
        g = self.geometry
        if not g.max_grammar_bytes:
            raise RequestError("grammar", "a grammar needs a ring with a grammars region (RingGeometry."
                                          "max_grammar_bytes > 0)")
        if grammar.vocab_size != g.vocab_size:
            raise RequestError("grammar", f"the grammar was compiled for {grammar.vocab_size} tokens, but this ring's "
                                          f"model has {g.vocab_size} (RingGeometry.vocab_size)")
        room = 4 * len(self.words)
        if grammar.nbytes > room:
            part = "" if room == g.max_grammar_bytes else f"this agent's {room}-byte part of "
            raise RequestError("grammar", f"the grammar takes {grammar.nbytes} bytes, more than {part}this ring's "
                                          f"grammars region of {g.max_grammar_bytes} (RingGeometry.max_grammar_bytes"
                                          f"{'' if not part else ', split among the agent processes'})")

    def acquire(self, grammar: Grammar) -> int:
        """Place ``grammar`` (if it is not placed yet) for one more request; return its placement's first word (the
        request header's ``grammar``). ``RingFull`` when grammars that requests in flight use leave no room for it
        now."""
        placed = self._placed.get(grammar.key)
        if placed is None:
            size = grammar.placed_words
            base = self._allocate(size)
            while base is None and self._evict_one():
                base = self._allocate(size)
            if base is None:
                raise RingFull(f"the grammar table has no room for a grammar of {4 * size} bytes while the "
                               "grammars of the requests in flight hold it: retry once some finish")
            self._write(base, grammar.placed(base, next(self._ids)))
            placed = self._placed[grammar.key] = Placement(base, size, 0)
        self._placed.move_to_end(grammar.key)
        placed.users += 1
        return placed.base

    def release(self, grammar: Grammar) -> None:
        """One request that followed ``grammar`` is done (the GPU side reads it no more for that request)."""
        self._placed[grammar.key].users -= 1

    def _allocate(self, size: int) -> int | None:
        for k, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[k]
                else:
                    self._free[k] = (start + size, length - size)
                return start
        return None

    def _evict_one(self) -> bool:
        """Free the least recently used grammar no request uses; False if every placed grammar has users."""
        key = next((key for key, p in self._placed.items() if p.users == 0), None)
        if key is None:
            return False
        placed = self._placed.pop(key)
        k = bisect.bisect(self._free, (placed.base, 0))
        start, length = placed.base, placed.size
        if k < len(self._free) and self._free[k][0] == start + length:      # merge with the run after
            length += self._free.pop(k)[1]
        if k > 0 and sum(self._free[k - 1]) == start:                      # and the run before
            start, length = self._free[k - 1][0], self._free[k - 1][1] + length
            k -= 1
            del self._free[k]
        self._free.insert(k, (start, length))
        return True
