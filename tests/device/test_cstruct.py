"""blink.device.cstruct: the C declarations the shim reads its records through lay every field where the numpy dtype
has it, by C's layout rules walked in Python (each field at the next multiple of its alignment, the struct's size
a multiple of its largest); NVRTC compiles them (tests/device/test_image.py links the shim behind them)."""
import re

import numpy as np
import pytest

from blink.device.cstruct import C_TYPES, c_struct
from blink.device.image import SHIM_STRUCTS

SIZES = {c: np.dtype(n).itemsize for n, c in C_TYPES.items()} | {"unsigned char": 1}


def c_layout(declaration: str) -> tuple[dict[str, int], int]:
    """(field -> offset, sizeof) of the first struct in ``declaration``, as a C compiler lays it out."""
    offset, largest, offsets = 0, 1, {}
    for ctype, name, dims in re.findall(r"^  ([a-z ]+?) (\w+)((?:\[\d+\])*);$", declaration, re.M):
        size = SIZES[ctype]
        offset = -(-offset // size) * size
        offsets[name] = offset
        offset += size * int(np.prod([int(d) for d in re.findall(r"\d+", dims)] or [1]))
        largest = max(largest, size)
    return offsets, -(-offset // largest) * largest


@pytest.mark.parametrize("name", list(SHIM_STRUCTS))
def test_every_field_lies_where_the_dtype_has_it(name):
    dtype = SHIM_STRUCTS[name]
    offsets, size = c_layout(c_struct(name, dtype))
    assert {field: offset for field, offset in offsets.items() if not field.startswith("_pad")} == \
        {field: dtype.fields[field][1] for field in dtype.names}
    assert size == dtype.itemsize


def test_gaps_and_a_tail_are_padded_and_a_misplaced_field_refused():
    gappy = np.dtype({"names": ["a", "b", "c"], "formats": ["<u4", "<u8", ("<f4", (3,))], "offsets": [0, 8, 20],
                      "itemsize": 40})
    assert c_layout(c_struct("Gappy", gappy)) == ({"a": 0, "_pad4": 4, "b": 8, "_pad16": 16, "c": 20,
                                                   "_pad32": 32}, 40)
    misplaced = np.dtype({"names": ["a", "b"], "formats": ["<u4", "<u8"], "offsets": [0, 4], "itemsize": 16})
    with pytest.raises(ValueError, match="Misplaced.b at byte 4 is not aligned to its 8-byte type"):
        c_struct("Misplaced", misplaced)
    with pytest.raises(ValueError, match="no C type for float64"):
        c_struct("Wide", np.dtype([("x", "<f8")]))
