"""The extras of the blink-serve distribution (pyproject.toml) a part of blink needs, checked where that part
starts: a missing one is one line naming the ``pip install`` that adds it, not a traceback from an engine process.

The core install is the agent. The engine extra adds torch and numba-cuda (the model, the scheduler and its CUDA
simulator); the gpu extra adds the CUDA 13.0 wheels the scheduler image is compiled and linked with on the GPU. That
one is not checked here: a GPU machine may hold the same libraries in a CUDA toolkit, where numba-cuda and
cuda-bindings find them by their own search (docs/gpu.md says what its absence looks like).
"""
from __future__ import annotations

import importlib.util

from blink.errors import MissingExtra

DISTRIBUTION = "blink-serve"
ENGINE_MODULES = ("torch", "numba")     # numba.cuda is numba-cuda's


def require_engine(what: str) -> None:
    """``MissingExtra`` unless the engine extra's modules are importable; ``what`` names what needs them."""
    missing = [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"{what} needs the engine extra ({', '.join(missing)} not installed): "
                           f"pip install '{DISTRIBUTION}[engine]'")
