"""The server's default sampling, for requests that leave a field out: the model's ``generation_config.json`` (as
vLLM's ``--generation-config auto``), or the OpenAI API's own defaults (``vllm``), or another directory's file.

From the file: ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` and ``max_new_tokens`` (the default
``max_tokens``), as vLLM reads them. A field the file does not give keeps the API's default: temperature 1, no top-p
or top-k filter, no repetition penalty, and for ``max_tokens`` all the room the context leaves (chat; completions
default to 16, as OpenAI's API).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

GENERATION_CONFIGS = ("auto", "vllm")       # or a directory holding a generation_config.json


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"generation config temperature must be a number >= 0 (got {self.temperature!r})")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"generation config top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"generation config top_k must be an int >= 0 (got {self.top_k!r})")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise ValueError(f"generation config repetition_penalty must be a number > 0 (got "
                             f"{self.repetition_penalty!r})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"generation config max_new_tokens must be an int >= 1 (got {self.max_tokens!r})")


def sampling_defaults(model_dir, generation_config: str = "auto") -> SamplingDefaults:
    """The defaults ``--generation-config`` names: ``auto`` (the model's file), ``vllm`` (the API's), or a
    directory with a ``generation_config.json``."""
    if generation_config == "vllm":
        return SamplingDefaults()
    directory = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    path = directory / "generation_config.json"
    if generation_config != "auto" and not path.is_file():
        raise FileNotFoundError(f"--generation-config {generation_config!r}: no generation_config.json there (use "
                                f"auto, vllm or a directory holding one)")
    config = json.loads(path.read_text()) if path.is_file() else {}
    fields = {"temperature": config.get("temperature"), "top_p": config.get("top_p"), "top_k": config.get("top_k"),
              "max_tokens": config.get("max_new_tokens"), "repetition_penalty": config.get("repetition_penalty")}
    return SamplingDefaults(**{k: v for k, v in fields.items() if v is not None})
