"""How several agents serve one ring (``blink serve --agent-processes N``): agent ``index`` of ``agents`` owns a
``Share`` of it, what it alone writes, so that no lock crosses processes on a request's path:

- its **slots**: a contiguous range, ``[index × n_slots // agents, (index + 1) × n_slots // agents)``; the ranges of
  the ``agents`` shares tile the ring;
- its **part of the grammars region**: the same split of the region's words;
- its **doorbell values**. The GPU acts on ``submitted`` and ``cancels`` when the word differs from the value it
  last acted on (``device/doorbells.py``), so a write is missed only if it puts back a value the GPU already acted on.
  Agent ``index`` writes ``c × agents + index``, ``c`` its own count of writes: the ``agents`` residues keep the
  agents' values apart, and each agent's count only grows. Its ``restarts``-th start (it replaces an agent of the
  same index that died) counts in a range of its own, ``[restarts × 2³², (restarts + 1) × 2³²)`` (an agent writes
  fewer than 2³² times): from ``word // agents`` when the word it found holds a count of that range (an agent that
  attaches again to a ring whose word it wrote continues its count), else from the range's start. Continuing from
  a word another agent wrote from a higher range would take a start's counts into its successor's range, which the
  successor may then write again. So no value is ever written twice, and however the agents' writes interleave the
  GPU sees every one. One agent (``agents = 1``) never restarted: the word is its count of writes, as the control
  block's documentation says.

The slot range is also what an agent locks in the ring's file (``RemoteMemory.claim_agent``): one agent per range.
"""
from __future__ import annotations

from dataclasses import dataclass

RESTART_STRIDE = 1 << 32    # an agent's restarts-th start counts its doorbell writes from restarts × this


@dataclass(frozen=True)
class Share:
    """Agent ``index`` of ``agents`` serving one ring, started for the ``restarts``-th time (0: the first)."""

    index: int = 0
    agents: int = 1
    restarts: int = 0

    def __post_init__(self):
        for name, low in (("agents", 1), ("index", 0), ("restarts", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Share.{name} must be an int >= {low} (got {value!r})")
        if self.index >= self.agents:
            raise ValueError(f"Share.index must be below Share.agents = {self.agents} (got {self.index})")

    def slots(self, n_slots: int) -> range:
        """This agent's slots of a ring of ``n_slots``; ``ValueError`` if the ring has fewer slots than agents."""
        if n_slots < self.agents:
            raise ValueError(f"{self.agents} agents need a ring of at least {self.agents} slots (it has {n_slots}): "
                             "give it more (--slots) or run fewer agent processes (--agent-processes)")
        return self._part(n_slots)

    def words(self, n_words: int) -> range:
        """This agent's words of a grammars region of ``n_words``."""
        return self._part(n_words)

    def _part(self, n: int) -> range:
        return range(self.index * n // self.agents, (self.index + 1) * n // self.agents)

    def first_count(self, word: int) -> int:
        """The count this agent's doorbell writes continue from, given the word's value when it attached: the
        word's count if it lies in this start's range of counts, else the range's start (the module docstring)."""
        start = self.restarts * RESTART_STRIDE
        count = word // self.agents
        return count if start <= count < start + RESTART_STRIDE else start

    def doorbell(self, count: int) -> int:
        """The value this agent writes for its ``count``-th write (see the module docstring)."""
        return count * self.agents + self.index

    def cap(self, total: int) -> int:
        """This agent's part of a server-wide cap of ``total`` (a queue's length, connections): ``ceil(total /
        agents)``, so that no agent's cap is 0 unless the whole is."""
        return -(-total // self.agents)
