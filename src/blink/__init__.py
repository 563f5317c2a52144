"""blink: LLM serving with no host CPU on the steady-state path."""

from blink.config import EngineConfig, SamplingParams
from blink.engine import Engine, GenerationOutput, StreamDelta

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "GenerationOutput", "SamplingParams", "StreamDelta"]
