"""Validation shared by the kernels' launch shapes (``moe.Tiles``, ``attention.Tiles``): frozen dataclasses whose
tile sizes are powers of two of at least 16 (``tl.dot``'s smallest operand) and whose warps and pipeline stages are
ones Triton accepts. Errors name the class and the field."""
from __future__ import annotations

from dataclasses import fields


def check_tiles(shape) -> None:
    """Raises ValueError naming the first bad field of ``shape``: every field but ``num_warps``, ``num_stages`` and
    ``split_k`` (a count of programs sharing one reduction) is a tile size."""
    owner = type(shape).__name__
    for field in fields(shape):
        value = getattr(shape, field.name)
        if field.name == "num_warps":
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{owner}.num_warps must be 1, 2, 4, 8 or 16 (got {value!r})")
        elif field.name in ("num_stages", "split_k"):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{owner}.{field.name} must be a positive int (got {value!r})")
        elif not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{owner}.{field.name} must be a power of two >= 16 (got {value!r})")
