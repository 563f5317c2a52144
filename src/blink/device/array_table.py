"""The scheduler's arrays as the GPU image reads them: an address table in device memory, read where it is used.

On the GPU, ``SchedulerArrays`` is the address of a table of ``TABLE_WORDS`` int64 (``table``: ``FIELD_WORDS`` per
field, for field ``k`` its device address at word ``FIELD_WORDS × k``, then its shape), written once by the host before
the loop starts. Device code reads ``s.seq_lens`` as it does in the simulator, where ``s`` is the tuple of arrays
itself; on the GPU that attribute is lowered to an array built from the table's words at that very use. So no array's
address or shape stays in a register past its use: the ~80 arrays' descriptors, built once and carried through a phase,
were what the iteration spilled (1 KiB per thread). The compiler reuses a word it loaded only while no store in between
could have changed it, so it reloads words often: the loop kernels (shim.cu) copy the table into shared memory where
an execution starts and hand the iteration that copy, where a reload is ~30 cycles (from global memory it was an L2
round trip after each of the iteration's fences, which invalidate L1).

``register()`` teaches numba the type (``SchedulerArraysTable``, whose value is the table's address) and the
lowering, and returns ``scheduler_arrays(table)``, which gives the image's entry its value.
"""
from __future__ import annotations

import functools

import numpy as np

from blink.device.arrays import ring_arrays, state_arrays, zero_history
from blink.device.config import SchedulerConfig
from blink.device.state import SchedulerArrays
from blink.device.step import StepLayout
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout

FIELD_WORDS = 3                                     # a field's address, then up to two dimensions
TABLE_WORDS = FIELD_WORDS * len(SchedulerArrays._fields)


def array_spec() -> list[tuple[str, np.dtype, int]]:
    """(field, dtype, ndim) of every ``SchedulerArrays`` field; sizes do not matter, so a tiny instance tells."""
    geometry = RingGeometry(n_slots=1, max_prompt_tokens=1, max_output_tokens=1, max_stop_ids=1, prefix_page_size=1)
    layout = RingLayout(geometry)
    step = StepLayout(max_num_batched_tokens=1, max_num_seqs=1, max_pages_per_seq=1)
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, page_size=1, num_pages=1, max_model_len=1)
    arrays = {**ring_arrays(layout.view(bytearray(layout.size))),
              **{name: np.zeros(shape, dtype) for name, (shape, dtype) in step.fields().items()},
              "history_tokens": zero_history(config), **state_arrays(config, geometry, step)}
    return [(name, arrays[name].dtype, arrays[name].ndim) for name in SchedulerArrays._fields]


def table(arrays: dict[str, tuple[int, tuple]]) -> np.ndarray:
    """The table's words for ``arrays`` (field -> (device address, shape)), every field of ``SchedulerArrays``."""
    words = np.zeros(TABLE_WORDS, np.int64)
    for k, name in enumerate(SchedulerArrays._fields):
        address, shape = arrays[name]
        if len(shape) >= FIELD_WORDS:
            raise ValueError(f"the address table holds arrays of at most {FIELD_WORDS - 1} dimensions; {name} has "
                             f"shape {shape}")
        words[FIELD_WORDS * k] = address
        words[FIELD_WORDS * k + 1: FIELD_WORDS * k + 1 + len(shape)] = shape
    return words


@functools.cache
def register():
    """Teach numba (compiling for the GPU) the table's type and its attributes, once; return ``scheduler_arrays``,
    the device function that makes a table's address (``int64 *``) that type."""
    from numba import types
    from numba.cuda.extending import infer_getattr, intrinsic, lower_getattr_generic, models, register_model
    from numba.cuda.np.numpy_support import from_dtype
    from numba.cuda.typing.templates import AttributeTemplate

    fields = {name: (k, types.Array(from_dtype(dtype), ndim, "C"))
              for k, (name, dtype, ndim) in enumerate(array_spec())}

    class SchedulerArraysType(types.Type):
        def __init__(self):
            super().__init__(name="SchedulerArraysTable")

    arrays_type = SchedulerArraysType()

    @register_model(SchedulerArraysType)
    class _Model(models.PrimitiveModel):        # its value: the table's address, an int64 *
        def __init__(self, dmm, fe_type):
            super().__init__(dmm, fe_type, dmm.lookup(types.CPointer(types.int64)).get_value_type())

    @infer_getattr
    class _Attributes(AttributeTemplate):
        key = arrays_type

        def generic_resolve(self, typ, attr):
            return fields[attr][1] if attr in fields else None

    @lower_getattr_generic(SchedulerArraysType)
    def _attribute(context, builder, typ, table, attr):
        k, array_type = fields[attr]

        def word(index):
            return builder.load(builder.gep(table, [context.get_constant(types.intp, index)]))
        shape = [word(FIELD_WORDS * k + 1 + d) for d in range(array_type.ndim)]
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(array_type.dtype)))
        strides = [itemsize]                    # C order: the last dimension's stride is the item's size
        for extent in reversed(shape[1:]):
            strides.insert(0, builder.mul(strides[0], extent))
        array = context.make_array(array_type)(context, builder)
        context.populate_array(array, data=builder.inttoptr(word(FIELD_WORDS * k), array.data.type), shape=shape,
                               strides=strides, itemsize=itemsize, meminfo=None)
        return array._getvalue()

    @intrinsic
    def scheduler_arrays(typingctx, table):
        def codegen(context, builder, signature, args):
            return args[0]
        return arrays_type(table), codegen

    return scheduler_arrays
