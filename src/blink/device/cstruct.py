"""C declarations of numpy record dtypes, for the CUDA C++ shim (``shim.cu``): the memory the shim reads is declared
once, as the dtype the Python side reads and writes, and the shim addresses it by field name.

``c_struct`` writes a ``struct`` whose fields lie at the dtype's byte offsets: each field is naturally aligned there
(checked), so the padding written out between them is all the padding a C compiler puts in, and the offsets are the
dtype's; a ``static_assert`` of the size stops a declaration that drifted from its dtype from compiling. (NVRTC has no
``offsetof`` usable in a constant expression, so the offsets are checked here instead.)
"""
from __future__ import annotations

import numpy as np

# numpy base type -> C type, for the field types the shared records use.
C_TYPES = {np.dtype("<i4"): "int", np.dtype("<u4"): "unsigned int", np.dtype("<i8"): "long long",
           np.dtype("<u8"): "unsigned long long", np.dtype("<f4"): "float"}


def c_struct(name: str, dtype: np.dtype) -> str:
    """``struct NAME { ... };`` with ``dtype``'s fields at its offsets, then an assert of its size."""
    fields = sorted(((offset, field, ftype) for field, (ftype, offset, *_) in dtype.fields.items()),
                    key=lambda f: f[0])
    lines, end = [f"struct {name} {{"], 0
    for offset, field, ftype in fields:
        if offset > end:
            lines.append(f"  unsigned char _pad{end}[{offset - end}];")
        base = ftype.base
        if base not in C_TYPES:
            raise ValueError(f"{name}.{field}: no C type for {ftype.base} (one of {', '.join(map(str, C_TYPES))})")
        if offset % base.itemsize:
            raise ValueError(f"{name}.{field} at byte {offset} is not aligned to its {base.itemsize}-byte type")
        dims = "".join(f"[{n}]" for n in ftype.shape)
        lines.append(f"  {C_TYPES[base]} {field}{dims};")
        end = offset + ftype.itemsize
    if dtype.itemsize > end:
        lines.append(f"  unsigned char _pad{end}[{dtype.itemsize - end}];")
    lines += ["};", f'static_assert(sizeof({name}) == {dtype.itemsize}, "{name} is not its dtype");']
    return "\n".join(lines) + "\n"
