"""numba-cuda, imported the way blink's device code needs it, on a GPU machine, a GPU-less one, or the simulator.

Import ``cuda`` from here, never ``numba.cuda`` directly:

- numba-cuda 0.30.4 still calls ``np.row_stack``, which numpy 2.5 removed (the H200 image has numpy 2.5.2);
- numba-cuda's ``ldcv`` loads an array element only: ``load_volatile_field`` is its twin for a record's field
  (``load_volatile_field(s.control[0], "shutdown")``), an ``ld.global.cv`` at the field's address;
- the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is first imported) lacks ``ldcv``, so
  ``load_volatile`` and ``load_volatile_field`` fall back to a plain load there (the simulator has no caches to
  bypass), and ``clock`` (the SM cycle counter, for the scheduler's phase profile) reads 0;
- the simulator's ``cuda.jit`` takes no ``forceinline``: ``inlined`` is a device function that is inlined into its
  callers on the GPU (NVVM's ``alwaysinline``) and a plain one there;
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
    inlined = cuda.jit(device=True)

    def load_volatile(array, index):
        """A load that sees another agent's latest store (the ring is written by the NIC side)."""
        return array[index]

    def load_volatile_field(record, name):
        """``load_volatile`` of field ``name`` (a constant string) of ``record``."""
        return record[name]

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
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    load_volatile = cuda.ldcv  # ld.global.cv: bypass L1/L2 caching of host-mapped ring words
    inlined = cuda.jit(device=True, forceinline=True)

    @intrinsic
    def load_volatile_field(typingctx, record, name):
        """``ld.global.cv`` of field ``name`` (a constant string) of ``record``, as ``ldcv`` loads an element."""
        if not isinstance(record, types.Record) or not isinstance(name, types.StringLiteral):
            return None
        offset, field = record.offset(name.literal_value), record.typeof(name.literal_value)
        if not isinstance(field, (types.Integer, types.Float)) or field.bitwidth not in (32, 64):
            raise TypeError(f"load_volatile_field loads a 32- or 64-bit number, not {name.literal_value}: {field}")

        def codegen(context, builder, signature, args):
            value_type = context.get_value_type(field)
            pointer = cgutils.get_record_member(builder, args[0], offset, value_type)
            load = ir.InlineAsm(ir.FunctionType(value_type, [value_type.as_pointer()]),
                                f"ld.global.cv.b{field.bitwidth} $0, [$1];",
                                f"={'l' if field.bitwidth == 64 else 'r'},l", side_effect=True)
            return builder.call(load, [pointer])
        return field(record, name), codegen

    clock = cuda.declare_device("blink_clock", "int64()")   # clock64(), defined in shim.cu

    @cuda.jit(device=True)
    def add64(a, b):
        return a + b

    @cuda.jit(device=True)
    def mul64(a, b):
        return a * b

__all__ = ["cuda", "inlined", "load_volatile", "load_volatile_field", "clock", "add64", "mul64", "SIMULATOR"]
