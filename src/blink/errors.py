"""Every public exception of blink, importable from ``blink`` too.

A leaf module: it imports only the ring's own errors (``blink.ring.errors``), so every package may import it.
Errors about bad input (a configuration, a checkpoint, a request) are also ``ValueError``s; errors of a running
engine are ``RuntimeError``s. Every message says what was wrong and what to do.
"""
from blink.ring.errors import (BlinkError, EngineUnresponsive, IllegalTransition, RequestError, RingFull,
                               RingMismatch, RingRefused)


class EngineError(BlinkError):
    """The engine cannot start or run in this process (device, numba mode, scheduler loop)."""


class EngineClosed(BlinkError):
    """The engine was closed (or its loop has ended): no request can be submitted to it any more."""


class EngineUnavailable(BlinkError):
    """The engine cannot take or finish requests now (starting, stopped, unresponsive). Retry after
    ``retry_after_s`` (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(BlinkError):
    """Every ring slot is busy and the agent's wait queue is full. Retry after ``retry_after_s`` (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LaunchError(BlinkError):
    """A CUDA call of the scheduler (host side, or a device-side graph launch) failed."""


class HandshakeError(BlinkError, ValueError):
    """A setup message of the remote transports was malformed, or its peer cannot be served (version, transport,
    ring or host differ)."""


class RdmaError(BlinkError):
    """An RDMA device, queue pair or work request failed. The message names the operation, the status and what to
    do; after one, the connection is unusable and the agent must reconnect."""


class CudaIpcError(BlinkError):
    """A CUDA call of the IPC transport or of the ring's export failed; the message names the call and the error."""


class ConfigError(BlinkError, ValueError):
    """A model's config.json cannot be served (unknown architecture, missing or inconsistent fields)."""


class CheckpointError(BlinkError, ValueError):
    """A checkpoint does not match its config (missing, extra or misshapen tensors, unreadable files)."""


class MissingExtra(BlinkError, ImportError):
    """A part of blink that this install lacks (the engine without the engine extra). The message names the ``pip
    install`` that adds it."""


class GGUFError(BlinkError, ValueError):
    """A GGUF file cannot be converted (unsupported architecture, tensor type or metadata)."""


__all__ = ["BlinkError", "CheckpointError", "ConfigError", "CudaIpcError", "EngineClosed", "EngineError",
           "EngineUnavailable", "EngineUnresponsive", "GGUFError", "HandshakeError", "IllegalTransition", "LaunchError",
           "MissingExtra", "Overloaded", "RdmaError", "RequestError", "RingFull", "RingMismatch", "RingRefused"]
