"""The contract's errors: what either side of the ring raises when the other side or the region misbehaves.

``blink.errors`` re-exports them with every other public exception; this module imports nothing of blink, like the
rest of ``blink.ring``.
"""


class BlinkError(RuntimeError):
    """Base class of blink's runtime errors."""


class RingMismatch(BlinkError):
    """An existing ring region was written by a different layout (magic, version or geometry differ)."""


class IllegalTransition(BlinkError):
    """A slot state change that the NIC↔GPU state machine does not allow for that writer."""


class RingFull(BlinkError):
    """Every request slot is in use. Retry after ``Agent.poll`` has released finished requests (HTTP 429/503)."""


class EngineUnresponsive(BlinkError):
    """The GPU side stopped making progress (heartbeat frozen) or has stopped while requests were in flight."""
