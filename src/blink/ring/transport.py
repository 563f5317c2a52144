"""RemoteMemory: how the agent reaches the ring. Byte offsets only, so the same agent runs over any transport.

Ordering guarantee every implementation gives (the whole NIC↔GPU protocol rests on it):

- ``write(offset, data)`` is *in order*: once a later write is visible to the other side, every earlier write on the
  same RemoteMemory is visible in full. So "write the payload, then write the state word" publishes safely.
- ``read(offset, nbytes)`` returns a snapshot copy. Each naturally aligned 4- or 8-byte word in it is read whole (never
  torn), but words may come from different instants: readers load the announcing word first (one read), then the
  payload it announces (a later read).
- ``fence()`` returns once every earlier write is visible to the other side. Local and shared memory make stores
  visible in program order (x86-64 is TSO) so it does nothing there; RDMA waits for the write completions.
"""
from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod


class RemoteMemory(ABC):
    """A region of ``size`` bytes that the agent writes and reads by offset."""

    size: int

    @abstractmethod
    def write(self, offset: int, data) -> None:
        """Copy ``data`` (bytes-like) to ``[offset, offset + len(data))``, in order with earlier writes."""

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes:
        """Return a copy of ``[offset, offset + nbytes)``."""

    def fence(self) -> None:
        """Wait until every earlier write is visible to the other side."""

    def close(self) -> None:
        """Release this side's mapping."""

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"access [{offset}, {offset + nbytes}) is outside the {self.size}-byte region")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _MappedMemory(RemoteMemory):
    """A region this process can address directly; ``buffer`` is a writable memoryview of it."""

    buffer: memoryview

    def write(self, offset: int, data) -> None:
        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        self.buffer[offset:offset + len(data)] = data

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_range(offset, nbytes)
        return bytes(self.buffer[offset:offset + nbytes])

    def _unmap(self) -> None:
        try:
            self.buffer.release()
            self._map.close()
        except BufferError:
            pass  # numpy views of the region are still alive; the mapping goes away with the last of them


class LocalMemory(_MappedMemory):
    """An in-process, zero-filled buffer: tests and CPU mode, with the consumer in the same process."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"LocalMemory size must be >= 1 byte (got {size})")
        self.size = size
        # An anonymous mmap is page-aligned, so the engine can register it with the GPU like shared memory.
        self._map = mmap.mmap(-1, size)
        self.buffer = memoryview(self._map)

    def close(self) -> None:
        self._unmap()


SHM_NAME_RULE = "a file name in /dev/shm: not empty, '.' or '..', without '/' or NUL, at most 255 bytes"


def is_shm_name(name) -> bool:
    """Whether ``name`` is one file name the kernel takes (NAME_MAX: 255 bytes): ``SHM_NAME_RULE``."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\x00" not in name
            and len(name.encode("utf-8", "surrogateescape")) <= 255)


def _check_room(directory: str, size: int) -> None:
    """``ValueError`` if ``directory``'s filesystem cannot hold ``size`` bytes: the ring's file is sparse, so it would
    be created, and the first write to a page beyond the room would kill the process (SIGBUS) under load."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if size > free:
        raise ValueError(f"the ring takes {size / 2**20:.1f} MiB but {directory} has {free / 2**20:.1f} MiB free: give "
                         "it fewer slots or shorter sequences (--slots, --max-model-len), or a larger "
                         f"{directory} (docker run --shm-size)")


class SharedMemory(_MappedMemory):
    """A POSIX shared-memory region (``/dev/shm/<name>``) that another process opens by name.

    The creator owns the name: ``close()`` on the creator also unlinks it. Openers only unmap. The region is
    zero-filled at creation and page-aligned, so the engine can register it with the GPU (``cudaHostRegister``) and
    the scheduler reads it in place.
    """

    SHM_DIR = "/dev/shm"

    def __init__(self, name: str, size: int | None = None, *, create: bool = False):
        if not is_shm_name(name):
            raise ValueError(f"SharedMemory name must be {SHM_NAME_RULE} (got {name!r})")
        self.name = name
        self.path = os.path.join(self.SHM_DIR, name)
        self._owner = create
        if create:
            if size is None or size < 1:
                raise ValueError(f"SharedMemory size must be >= 1 byte when creating (got {size})")
            _check_room(self.SHM_DIR, size)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                raise FileExistsError(f"a shared-memory ring named {name!r} exists already ({self.path}): another "
                                      "engine uses it, or a killed one left it behind; pick another name, or remove "
                                      "the file if no engine runs on it") from None
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
        else:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                raise FileNotFoundError(f"no shared-memory ring named {name!r} ({self.path}): start the engine "
                                        "first, or pass the name it printed") from None
        try:
            self.size = os.fstat(fd).st_size
            if size is not None and size != self.size:
                raise ValueError(f"shared-memory ring {name!r} is {self.size} bytes, expected {size}")
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.buffer = memoryview(self._map)

    @classmethod
    def create(cls, name: str, size: int) -> "SharedMemory":
        return cls(name, size, create=True)

    @classmethod
    def open(cls, name: str, size: int | None = None) -> "SharedMemory":
        return cls(name, size)

    def close(self) -> None:
        self._unmap()
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
