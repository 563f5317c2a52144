"""Model definitions, checkpoint loading and the embedded default model (see ``DecoderLM`` for the step contract).

What names a model directory (``resolve_model``, ``default_model_path``, ``ModelConfig``) needs no torch: the agent
imports it where only blink's core install is (``blink agent`` on a DPU, docs/dpu.md). Everything that builds or
loads a model is torch, imported on first use (PEP 562), so ``from blink.models import load_model`` still works.
"""
from .config import ConfigError, ModelConfig
from .default import default_model_path
from .hub import resolve_model

# name -> the module of this package that defines it; each imports torch
_TORCH = {"CheckpointError": "loader", "build_model": "loader", "load_model": "loader", "random_model": "loader",
          "MemoryPlan": "memory", "plan_memory": "memory", "TensorParallel": "parallel"}

__all__ = ["ConfigError", "CheckpointError", "MemoryPlan", "ModelConfig", "build_model", "default_model_path",
           "load_model", "plan_memory", "random_model", "resolve_model", "TensorParallel"]


def __getattr__(name: str):
    if name not in _TORCH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_TORCH[name]}", __name__), name)
