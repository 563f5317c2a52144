"""The paper's four models at full size, and the two small ones users pick most (Qwen3-0.6B, Llama-3.2-1B), as
their HF ``config.json`` alone: ``shapes/<name>/config.json``.

Each directory is a model directory without weights, so it serves random-weight runs as is (``random_model``,
``EngineConfig(model=str(shape_dir(name)), load_format="dummy")``) and sizes memory plans (``blink.models.memory``).
"""
from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig

SHAPES = ("llama-3-8b", "phi-4", "qwen3-32b", "qwen3-30b-a3b", "qwen3-0.6b", "llama-3.2-1b")


def shape_dir(name: str) -> Path:
    if name not in SHAPES:
        raise ValueError(f"no model shape {name!r}; shapes: {', '.join(SHAPES)}")
    return Path(__file__).parent / name


def shape_config(name: str) -> ModelConfig:
    return ModelConfig.from_file(shape_dir(name))
