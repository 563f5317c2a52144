"""The extras of the blink-serve distribution (pyproject.toml) a part of blink needs, checked where that part
starts: a missing one is one line naming the ``pip install`` that adds it, not a traceback from deep inside an engine.

The core install is the agent. The engine extra adds torch and numba-cuda (the model, the scheduler and its CUDA
simulator); the gpu extra adds the CUDA 13.0 wheels the scheduler image is compiled and linked with on the GPU.
"""
from __future__ import annotations

import importlib.util
from importlib import metadata

from blink.errors import MissingExtra

DISTRIBUTION = "blink-serve"
ENGINE_MODULES = ("torch", "numba_cuda")
# The wheels of the gpu extra that nothing imports by name (NVRTC, nvJitLink and NVVM are loaded as libraries,
# libcudadevrt.a is linked): a system CUDA toolkit of another version would be found in their place.
GPU_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-nvjitlink", "nvidia-nvvm", "nvidia-cuda-runtime")


def require_engine(what: str) -> None:
    """``MissingExtra`` unless the engine extra's modules are importable; ``what`` names what needs them."""
    _require("engine", what, [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None])


def require_gpu(what: str) -> None:
    """``MissingExtra`` unless the gpu extra's CUDA 13.0 wheels are installed; ``what`` names what needs them."""
    _require("gpu", what, [d for d in GPU_WHEELS if not _installed(d)])


def _require(extra: str, what: str, missing: list[str]) -> None:
    if missing:
        raise MissingExtra(f"{what} needs the {extra} extra ({', '.join(missing)} not installed): "
                           f"pip install '{DISTRIBUTION}[{extra}]'")


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True
