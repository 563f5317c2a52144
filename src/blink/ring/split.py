"""``SplitMemory``: one ring address space over several ``RemoteMemory`` segments.

The ring's layout stays one byte-addressed contract even when its bytes sit in different memories (the request
side in GPU memory, the output side in host memory where its reader is): each segment holds a contiguous range of
ring offsets, and this facade routes every access by offset, splitting one that crosses a segment's end.

In order across segments: the segments are separate paths (a copy into GPU memory, a store into host memory), so a
write to one segment is not ordered with a later write to another by either path. ``write`` therefore fences the
segment it last wrote before it writes a different one: once a later write is visible, every earlier one is, as
``RemoteMemory`` promises. Writes that stay in one segment cost nothing extra.
"""
from __future__ import annotations

import bisect

from blink.ring.transport import RemoteMemory

# Where a ring's request side lives: with its output side in host memory, or in GPU memory (``request_side_bytes``).
REQUEST_SIDES = ("host", "device")
# GPU allocations, and the dma-buf ranges exported from them, come in whole pages of this size (a range of the bare
# ring size was refused on the H200 with CUDA_ERROR_INVALID_VALUE).
GPU_PAGE_BYTES = 2 << 20


def device_allocation_size(size: int) -> int:
    """What to allocate in GPU memory for ``size`` ring bytes that will be exported: whole GPU pages."""
    return -(-size // GPU_PAGE_BYTES) * GPU_PAGE_BYTES


def request_side_bytes(layout) -> int:
    """Where a ring's request side ends and its output side begins (``RingLayout``): control, status, headers, stop
    token ids, prompts and prefix keys are read by the scheduler; outputs and logprobs by the agent."""
    return layout.offset("outputs")


class Window(RemoteMemory):
    """Ring bytes ``[start, start + size)`` of ``memory``, addressed from 0: a segment of a ``SplitMemory`` cut out of
    a memory that maps the whole ring (the output side of the engine's shared-memory ring, say). ``close()`` closes
    ``memory`` only if ``owns`` it (an agent that mapped the object for this window alone); else its owner does.
    A window of a mapped memory (one with a ``buffer``) is mapped too: ``buffer`` is its slice."""

    def __init__(self, memory: RemoteMemory, start: int, size: int, *, owns: bool = False):
        if start < 0 or size < 0 or start + size > memory.size:
            raise ValueError(f"window [{start}, {start + size}) is outside the {memory.size}-byte memory")
        self.memory, self.start, self.size, self.owns = memory, start, size, owns

    @property
    def buffer(self) -> memoryview:
        if not hasattr(self.memory, "buffer"):
            raise AttributeError(f"a window of a {type(self.memory).__name__} has no buffer: it is not mapped here")
        return self.memory.buffer[self.start:self.start + self.size]

    def write(self, offset: int, data) -> None:
        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        self.memory.write(self.start + offset, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_range(offset, nbytes)
        return self.memory.read(self.start + offset, nbytes)

    def fence(self) -> None:
        self.memory.fence()

    def close(self) -> None:
        if self.owns:
            self.memory.close()


class SplitMemory(RemoteMemory):
    """``segments``: ``(start, memory)`` pairs in ring-offset order, each ``memory`` holding ring bytes
    ``[start, start + memory.size)``; together they tile ``[0, size)``. ``close()`` closes every segment."""

    def __init__(self, segments: list[tuple[int, RemoteMemory]]):
        if not segments:
            raise ValueError("SplitMemory needs at least one segment")
        end = 0
        for start, memory in segments:
            if start != end:
                raise ValueError(f"segment at ring offset {start} should start at {end}: segments must tile the "
                                 "ring in order")
            end = start + memory.size
        self.segments = list(segments)
        self.size = end
        self._starts = [start for start, _ in self.segments]
        self._last_written: RemoteMemory | None = None

    def _pieces(self, offset: int, nbytes: int):
        """``(segment memory, offset in it, offset in the access, length)`` for each segment an access touches."""
        k = bisect.bisect_right(self._starts, offset) - 1
        done = 0
        while done < nbytes:
            start, memory = self.segments[k]
            local = offset + done - start
            length = min(nbytes - done, memory.size - local)
            if length <= 0:
                k += 1
                continue
            yield memory, local, done, length
            done += length

    def write(self, offset: int, data) -> None:
        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        for memory, local, done, length in self._pieces(offset, len(data)):
            if self._last_written is not None and self._last_written is not memory:
                self._last_written.fence()
            memory.write(local, data[done:done + length])
            self._last_written = memory

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_range(offset, nbytes)
        return b"".join(memory.read(local, length) for memory, local, _, length in self._pieces(offset, nbytes))

    def fence(self) -> None:
        """Every other segment was fenced when the writes moved on from it; only the last written one is left."""
        if self._last_written is not None:
            self._last_written.fence()

    def close(self) -> None:
        for _, memory in self.segments:
            memory.close()
