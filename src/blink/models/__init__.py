"""Model definitions, checkpoint loading and the embedded default model (see ``DecoderLM`` for the step contract)."""
from .config import ConfigError, ModelConfig
from .default import default_model_path
from .hub import resolve_model
from .loader import CheckpointError, build_model, load_model, random_model
from .memory import MemoryPlan, plan_memory
from .parallel import TensorParallel

__all__ = ["ConfigError", "CheckpointError", "MemoryPlan", "ModelConfig", "build_model", "default_model_path",
           "load_model", "plan_memory", "random_model", "resolve_model", "TensorParallel"]
