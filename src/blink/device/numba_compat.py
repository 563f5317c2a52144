"""numba-cuda, imported the way blink's device code needs it, on a GPU machine, a GPU-less one, or the simulator.

Import ``cuda`` from here, never ``numba.cuda`` directly:

- numba-cuda 0.30.4 still calls ``np.row_stack``, which numpy 2.5 removed (the H200 image has numpy 2.5.2);
- the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is first imported) lacks ``ldcv``, so
  ``load_volatile`` falls back to a plain load there (the simulator has no caches to bypass), and ``clock`` (the
  SM cycle counter, for the scheduler's phase profile) reads 0;
- the simulator computes with numpy scalars, which warn where uint64 arithmetic wraps around, as the GPU's does
  silently: ``add64`` and ``mul64`` wrap without a word on both.
"""
from __future__ import annotations

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config as _config  # noqa: E402
from numba import cuda  # noqa: E402

SIMULATOR = bool(_config.ENABLE_CUDASIM)
_MASK64 = (1 << 64) - 1

if SIMULATOR:
    def load_volatile(array, index):
        """A load that sees another agent's latest store (the ring is written by the NIC side)."""
        return array[index]

    def clock():
        """The SM's cycle counter (0 in the simulator, which has no cycles)."""
        return 0

    def add64(a, b):
        """``a + b`` modulo 2**64, for uint64 ``a`` and ``b``."""
        return np.uint64((int(a) + int(b)) & _MASK64)

    def mul64(a, b):
        """``a * b`` modulo 2**64, for uint64 ``a`` and ``b``."""
        return np.uint64((int(a) * int(b)) & _MASK64)
else:
    load_volatile = cuda.ldcv  # ld.global.cv: bypass L1/L2 caching of host-mapped ring words
    clock = cuda.declare_device("blink_clock", "int64()")   # clock64(), defined in launch.py's shim

    @cuda.jit(device=True)
    def add64(a, b):
        return a + b

    @cuda.jit(device=True)
    def mul64(a, b):
        return a * b

__all__ = ["cuda", "load_volatile", "clock", "add64", "mul64", "SIMULATOR"]
