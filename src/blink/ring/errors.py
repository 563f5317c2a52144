"""The contract's errors: what either side of the ring raises when the other side or the region misbehaves.

``blink.errors`` re-exports them with every other public exception; this module imports nothing of blink, like the
rest of ``blink.ring``.
"""


class BlinkError(RuntimeError):
    """Base class of blink's runtime errors."""


class RequestError(BlinkError, ValueError):
    """One field of a request is out of range for the ring or the type that stores it (HTTP 400). ``field`` names
    it (a ``SamplingParams`` field, ``prompt_tokens``, ``priority``, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RingMismatch(BlinkError):
    """An existing ring region was written by a different layout (magic, version or geometry differ), or is a copy
    of a ring that its engine serves from elsewhere."""


class IllegalTransition(BlinkError):
    """A slot state change that the NIC↔GPU state machine does not allow for that writer."""


class RingFull(BlinkError):
    """Every request slot is in use. Retry after ``Agent.poll`` has released finished requests (HTTP 429/503)."""


class EngineUnresponsive(BlinkError):
    """The GPU side stopped making progress (heartbeat frozen) or has stopped while requests were in flight."""


class RingRefused(BlinkError):
    """A shared-memory ring this process must not attach to: another user's, open to other users, or already
    served by another agent."""
