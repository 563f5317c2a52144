"""``device/array_table.py``: the address table the GPU image reads its arrays from holds, for field ``k`` of
``SchedulerArrays``, its address at word ``FIELD_WORDS × k`` and its shape after it; arrays of more dimensions than the
table has room for are refused; and numba lays out every field's element as numpy does (the device computes strides from
it).
Whether the image links and spills nothing: ``test_image.py``."""
import pytest

from blink.device.array_table import FIELD_WORDS, TABLE_WORDS, array_spec, table
from blink.device.state import SchedulerArrays
from tests.device.fresh_python import run_python


def fake_arrays(shapes: dict[str, tuple] | None = None) -> dict[str, tuple[int, tuple]]:
    """Every field at a distinct made-up address, with a distinct shape of its own number of dimensions."""
    out = {}
    for k, (name, _, ndim) in enumerate(array_spec()):
        out[name] = (0x7F00_0000_0000 + 4096 * k, tuple(100 * k + d + 1 for d in range(ndim)))
    out.update(shapes or {})
    return out


def test_the_table_holds_each_arrays_address_then_its_shape():
    arrays = fake_arrays()
    words = table(arrays)
    assert words.shape == (TABLE_WORDS,) == (FIELD_WORDS * len(SchedulerArrays._fields),)
    for k, name in enumerate(SchedulerArrays._fields):
        address, shape = arrays[name]
        first = FIELD_WORDS * k
        assert words[first] == address, name
        assert tuple(words[first + 1: first + 1 + len(shape)]) == shape, name
        assert all(words[first + 1 + len(shape): first + FIELD_WORDS] == 0), name


def test_an_array_of_three_dimensions_is_refused_by_name():
    with pytest.raises(ValueError, match=r"seq_lens has shape \(2, 3, 4\)"):
        table(fake_arrays({"seq_lens": (0x1000, (2, 3, 4))}))


def test_numba_lays_out_every_element_as_numpy_does():
    """The lowering takes an element's size from numba's data layout to compute strides; a record numba laid out
    otherwise than numpy would make every row of that array land at the wrong address."""
    out = run_python("""
        from numba.cuda.descriptor import cuda_target
        from numba.cuda.np.numpy_support import from_dtype
        from blink.device.array_table import array_spec
        context = cuda_target.target_context
        for name, dtype, _ in array_spec():
            size = context.get_abi_sizeof(context.get_data_type(from_dtype(dtype)))
            print(name, size, dtype.itemsize)
    """, simulator=False)
    rows = [line.split() for line in out.splitlines()]
    assert [name for name, _, _ in rows] == list(SchedulerArrays._fields)
    assert [(name, numba_size) for name, numba_size, _ in rows] == [(name, size) for name, _, size in rows]
