"""CUDA driver and runtime calls through cuda-python, with errors raised by name (``LaunchError``), and GPU memory
as a ``RemoteMemory``."""
from __future__ import annotations

import ctypes
import threading

from blink.errors import LaunchError
from blink.ring.transport import RemoteMemory


def check(result):
    """Unwrap a cuda.bindings result tuple, raising ``LaunchError`` with the error's name."""
    from cuda.bindings import driver, runtime

    code = result[0]
    if int(code) != 0:
        if isinstance(code, runtime.cudaError_t):
            name = runtime.cudaGetErrorName(code)[1].decode()
        else:
            name = driver.cuGetErrorName(code)[1].decode()
        raise LaunchError(f"CUDA call failed: {name}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def error_name(code: int) -> str:
    """The runtime's name of a ``cudaError_t`` code (as the device loop stores it in ``launch_error``)."""
    from cuda.bindings import runtime

    try:
        return runtime.cudaGetErrorName(runtime.cudaError_t(code))[1].decode()
    except ValueError:
        return f"cudaError {code}"


class DeviceMemory(RemoteMemory):
    """``size`` bytes of GPU memory at ``address`` (the current context's), as a ``RemoteMemory``: the engine's own
    view of a ring's request side in GPU memory, for its control words (shutdown, alive, counters) and for an agent
    in the engine's process.

    Writes are synchronous copies from pinned memory (a copy from pageable memory may return before its DMA lands,
    which would break the in-order promise); reads copy back. Any thread may call it: each access makes the
    allocation's context current and holds a lock over the one staging buffer. Agents in other processes use
    ``blink.nic.remote.ipc``.
    """

    def __init__(self, address: int, size: int):
        from cuda.bindings import driver

        self.address, self.size = address, size
        self._context = check(driver.cuCtxGetCurrent())
        self._lock = threading.Lock()
        self._staging = int(check(driver.cuMemHostAlloc(max(size, 1), 0)))
        self._view = memoryview((ctypes.c_char * max(size, 1)).from_address(self._staging)).cast("B")

    def write(self, offset: int, data) -> None:
        from cuda.bindings import driver

        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        with self._lock:
            check(driver.cuCtxSetCurrent(self._context))
            self._view[:len(data)] = data
            check(driver.cuMemcpyHtoD(self.address + offset, self._staging, len(data)))

    def read(self, offset: int, nbytes: int) -> bytes:
        from cuda.bindings import driver

        self._check_range(offset, nbytes)
        with self._lock:
            check(driver.cuCtxSetCurrent(self._context))
            check(driver.cuMemcpyDtoH(self._staging, self.address + offset, nbytes))
            return bytes(self._view[:nbytes])

    def close(self) -> None:
        from cuda.bindings import driver

        with self._lock:
            if self._staging:
                self._view.release()
                driver.cuMemFreeHost(self._staging)
                self._staging = 0
