"""blink: LLM serving with no host CPU on the steady-state path.

The public API: ``Engine`` and ``AsyncEngine`` serve a model to Python code (``EngineConfig`` says which and how,
``SchedulerConfig`` the scheduler's limits, ``SamplingParams`` how to sample a request); ``GenerationOutput`` and
``StreamDelta`` are what they return; every exception they raise is importable from here (``blink.errors``).
"""

from blink.config import EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from blink.engine import AsyncEngine, AsyncRequestStream, Engine, RequestStream
from blink.errors import (BlinkError, CheckpointError, ConfigError, CudaIpcError, EngineClosed, EngineError,
                          EngineUnavailable, EngineUnresponsive, GGUFError, HandshakeError, IllegalTransition,
                          LaunchError, MissingExtra, Overloaded, RdmaError, RequestError, RingFull, RingMismatch,
                          RingRefused)
from blink.outputs import GenerationOutput, StreamDelta
from blink.version import __version__  # noqa: F401 (blink.__version__, as packages have it)

__all__ = ["AsyncEngine", "AsyncRequestStream", "BlinkError", "CheckpointError", "ConfigError", "CudaIpcError",
           "Engine", "EngineClosed", "EngineConfig", "EngineError", "EngineUnavailable", "EngineUnresponsive",
           "GGUFError", "GenerationOutput", "HandshakeError", "IllegalTransition", "LaunchError", "MissingExtra",
           "Overloaded", "RdmaError", "RequestError", "RequestStream", "RingFull", "RingMismatch", "RingRefused",
           "SamplingParams", "SchedulerConfig", "SpeculativeConfig", "StreamDelta"]
