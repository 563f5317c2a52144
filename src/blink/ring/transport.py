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

import errno
import fcntl
import mmap
import os
import stat
import struct
from abc import ABC, abstractmethod

import numpy as np

from blink.ring.errors import RingRefused


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

    def claim_agent(self, slots: range) -> None:
        """Make this the only agent on ``slots`` of the region until ``close``; ``RingRefused`` if another agent has
        any of them (``blink.ring.shares``: each agent owns a range). Only shared memory, which any process of the
        user may open by name, needs it: elsewhere it does nothing."""

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"access [{offset}, {offset + nbytes}) is outside the {self.size}-byte region")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_WORDS = {4: np.dtype("<u4"), 8: np.dtype("<u8")}


class _MappedMemory(RemoteMemory):
    """A region this process can address directly; ``buffer`` is a writable memoryview of it."""

    buffer: memoryview

    def write(self, offset: int, data) -> None:
        """An aligned 4- or 8-byte write (a status word, a doorbell) is one store. memcpy is not: glibc's stores 4 to
        7 bytes as two overlapping words, so a 4-byte word is stored twice, and when the other side rewrites it
        between the two (the consumer admitting a slot just published: READY -> RUNNING), the second store puts
        READY back over RUNNING."""
        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        word = _WORDS.get(len(data))
        if word is not None and offset % len(data) == 0:
            np.frombuffer(self.buffer, word, 1, offset)[0] = np.frombuffer(data, word)[0]
        else:
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


def _free_bytes(directory: str) -> int:
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def _room_error(directory: str, size: int) -> ValueError:
    """What a ring that does not fit in ``directory`` is refused with."""
    free = _free_bytes(directory)
    return ValueError(f"the ring takes {size / 2**20:.1f} MiB but {directory} has {free / 2**20:.1f} MiB free: give "
                      "it fewer slots or shorter sequences (--slots, --max-model-len), or a larger "
                      f"{directory} (docker run --shm-size)")


# Bytes of a ring's file that its users lock (Linux open-file-description locks: per open file, released when it is
# closed, by whatever process, in whatever namespace): the creator holds CREATOR_BYTE while the ring is served, so a
# ring nobody holds it on is one a killed engine left behind; an agent holds byte AGENT_BYTE + s for each slot s of
# its range, one agent per slot (the locks are advisory: the bytes themselves are the control block's, untouched).
CREATOR_BYTE, AGENT_BYTE = 0, 1


def lock_bytes(fd: int, first: int, count: int = 1) -> bool:
    """Write-lock bytes ``[first, first + count)`` of ``fd``'s file for this open file description: False if
    another one holds any of them."""
    request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, first, count, 0)     # struct flock, l_pid 0
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def check_owned(fd: int, path: str) -> None:
    """``RingRefused`` unless the file open at ``fd`` is a regular file of this process's user that no other user
    may read or write (mode 0600, as an engine makes its ring): another user's file, or one open to others, may be a
    fake engine's, which would read every prompt and write the answers."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise RingRefused(f"{path} is not a regular file, so no blink engine made it: remove it or pick another name")
    if info.st_uid != os.geteuid():
        raise RingRefused(f"{path} belongs to uid {info.st_uid}, not to this process's user (uid {os.geteuid()}): "
                          "an agent attaches only to a ring its own user's engine made; run the agent as that user")
    if info.st_mode & 0o077:
        raise RingRefused(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}, an engine makes "
                          "its ring 0600), so others may have read or written it: not attached")


class SharedMemory(_MappedMemory):
    """A POSIX shared-memory region (``/dev/shm/<name>``) that another process opens by name.

    The creator owns the name: ``close()`` on the creator also unlinks it. Openers only unmap. The region is
    zero-filled at creation, its pages reserved then (a full ``/dev/shm`` later cannot fault a write to it: SIGBUS),
    and page-aligned, so the engine can register it with the GPU (``cudaHostRegister``) and the scheduler reads it in
    place. The creator makes it 0600 and holds its ``CREATOR_BYTE`` lock until ``close``; an opener refuses a region
    that is not its own user's with mode 0600 (``check_owned``), and never follows a link.
    """

    SHM_DIR = "/dev/shm"

    def __init__(self, name: str, size: int | None = None, *, create: bool = False):
        if not is_shm_name(name):
            raise ValueError(f"SharedMemory name must be {SHM_NAME_RULE} (got {name!r})")
        self.name = name
        self.path = os.path.join(self.SHM_DIR, name)
        self._owner = create
        fd = self._create(size) if create else self._open()
        try:
            self.size = os.fstat(fd).st_size
            if size is not None and size != self.size:
                raise ValueError(f"shared-memory ring {name!r} is {self.size} bytes, expected {size}")
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(self.path)
            raise
        self._fd = fd           # kept open: its locks last as long as it does
        self._companions: list[str] = []
        self.buffer = memoryview(self._map)

    def _create(self, size: int | None) -> int:
        if size is None or size < 1:
            raise ValueError(f"SharedMemory size must be >= 1 byte when creating (got {size})")
        if size > _free_bytes(self.SHM_DIR):       # said before a byte is taken
            raise _room_error(self.SHM_DIR, size)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise FileExistsError(f"a shared-memory ring named {self.name!r} exists already ({self.path}): another "
                                  "engine uses it, or a killed one left it behind; pick another name, or remove "
                                  "the file if no engine runs on it") from None
        try:
            lock_bytes(fd, CREATOR_BYTE)            # a file made just now: nobody else can hold it
            try:
                os.posix_fallocate(fd, 0, size)     # every page now: a write can never find /dev/shm full
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise _room_error(self.SHM_DIR, size) from None
                raise
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        return fd

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory ring named {self.name!r} ({self.path}): start the engine "
                                    "first, or pass the name it printed") from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise RingRefused(f"{self.path} is a symbolic link, so no blink engine made it: not attached") from None
        try:
            check_owned(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @classmethod
    def create(cls, name: str, size: int) -> "SharedMemory":
        return cls(name, size, create=True)

    @classmethod
    def open(cls, name: str, size: int | None = None) -> "SharedMemory":
        return cls(name, size)

    def also_remove(self, path: str) -> None:
        """The creator also removes ``path`` (a file that lives as long as the ring) when it closes."""
        self._companions.append(path)

    def claim_agent(self, slots: range) -> None:
        if not lock_bytes(self._fd, AGENT_BYTE + slots.start, len(slots)):
            which = f"slot {slots.start}" if len(slots) == 1 else f"slots {slots.start}-{slots.stop - 1}"
            raise RingRefused(f"another agent is attached to {which} of the ring {self.path} already: one agent per "
                              "slot (two would take each other's slots); stop it first, or start another engine")

    def close(self) -> None:
        self._unmap()
        if self._owner:
            for path in (self.path, *self._companions):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self._fd >= 0:
            os.close(self._fd)      # drops this side's locks (the creator's once the name is gone)
            self._fd = -1
