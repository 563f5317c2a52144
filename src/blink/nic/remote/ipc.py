"""CUDA IPC: a process on the engine's host that is not the engine writes and reads the engine's ring in GPU memory
(``CudaIpcMemory``, the foreign writer), and the engine's export of such a segment (``export_device_segment``: its
CUDA IPC handle, and the dma-buf fd that RDMA registers). cuda-python is imported lazily.

Ordering. ``RemoteMemory`` promises that once a later write is visible, every earlier one is. The scheduler is a
kernel of another process polling the ring; a copy engine's write into device memory is visible to it once the
copy has completed. Stream order would serialise two copies of one stream, but CUDA promises that order to later
work of the same stream, not to a kernel of another process that reads concurrently; and ``cuMemcpyHtoD`` from
pageable memory returns once the bytes are staged, before the DMA has landed. So each ``write`` copies from a pinned
staging buffer with ``cuMemcpyHtoD``, which for a pinned source returns only after the copy completed: the state
word's copy cannot start before its payload's has finished, a fact of time rather than of a stream's promise.
``fence()`` therefore has nothing left to wait for. (Without that, a ``cuStreamSynchronize`` between payload and
state word would be needed.) The readers' side of the same contract, which the scheduler must keep when the request
side moves to device memory: ring words are loaded volatile (a plain load may hit a stale L1 line), the state word
before its payload with a fence between; and the GPU's own writes that this process reads — tokens in host memory,
``n_generated`` in device memory — need ``__threadfence_system()`` between them, because only a system-scope fence
orders writes to two different memories for a reader outside the GPU.

Without MPS, kernels of different processes are time-sliced: a copy waits until the engine's context yields
(milliseconds). This transport is for correctness on one host, not for latency.
"""
from __future__ import annotations

import ctypes

from blink.errors import CudaIpcError
from blink.nic.remote.segments import DeviceSegment
from blink.ring.split import device_allocation_size
from blink.ring.transport import RemoteMemory

STAGING_BYTES = 1 << 20       # the pinned bounce buffer; longer accesses are copied in pieces
PCI_BUS_ID_CHARS = 16         # "0000:1b:00.0" and its terminating NUL fit


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaIpcError(f"the ipc transport over GPU memory needs cuda-python ({e}): pip install "
                           "'cuda-bindings==13.0.*'") from None
    return driver


def _check(result, what: str):
    """Unwrap a cuda.bindings result tuple; ``CudaIpcError`` naming ``what`` and the CUDA error otherwise."""
    driver = _driver()
    code = result[0]
    if int(code) != 0:
        raise CudaIpcError(f"{what} failed: {driver.cuGetErrorName(code)[1].decode()}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def _init(driver) -> None:
    try:
        _check(driver.cuInit(0), "cuInit")
    except RuntimeError as e:           # cuda-python raises this when libcuda.so.1 is not there at all
        raise CudaIpcError(f"the NVIDIA driver is not installed here ({e}): CUDA IPC works only on the engine's GPU "
                           "host; elsewhere use --transport rdma") from None


class CudaIpcMemory(RemoteMemory):
    """``size`` ring bytes of a GPU allocation another process exported (``handle``) on the GPU at ``pci_bus_id``.

    Writes and reads are synchronous copies through a pinned ``staging_bytes`` buffer (see the module docstring).
    """

    def __init__(self, handle: bytes, size: int, pci_bus_id: str, *, staging_bytes: int = STAGING_BYTES):
        driver = _driver()
        _init(driver)
        self.size = size
        self._device = _check(driver.cuDeviceGetByPCIBusId(pci_bus_id.encode()), f"finding the GPU at {pci_bus_id}")
        self._context = _check(driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self._base = self._host = None
        try:
            _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
            ipc = driver.CUipcMemHandle()
            ipc.reserved = handle
            lazy_peer_access = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            self._base = int(_check(driver.cuIpcOpenMemHandle(ipc, lazy_peer_access),
                                    "cuIpcOpenMemHandle (is the engine still running, on this host?)"))
            self._host = int(_check(driver.cuMemHostAlloc(staging_bytes, 0), "cuMemHostAlloc of the staging buffer"))
            self._staging = memoryview((ctypes.c_char * staging_bytes).from_address(self._host)).cast("B")
        except BaseException:
            self.close()
            raise

    def write(self, offset: int, data) -> None:
        """Copy ``data`` into the ring; returns once it is in device memory."""
        driver = _driver()
        data = memoryview(data).cast("B")
        self._check_range(offset, len(data))
        for done in range(0, len(data), len(self._staging)):
            piece = data[done:done + len(self._staging)]
            self._staging[:len(piece)] = piece
            _check(driver.cuMemcpyHtoD(self._base + offset + done, self._host, len(piece)),
                   f"cuMemcpyHtoD of {len(piece)} bytes to ring offset {offset + done}")

    def read(self, offset: int, nbytes: int) -> bytes:
        driver = _driver()
        self._check_range(offset, nbytes)
        pieces = []
        for done in range(0, nbytes, len(self._staging)):
            length = min(len(self._staging), nbytes - done)
            _check(driver.cuMemcpyDtoH(self._host, self._base + offset + done, length),
                   f"cuMemcpyDtoH of {length} bytes from ring offset {offset + done}")
            pieces.append(bytes(self._staging[:length]))
        return b"".join(pieces)

    def close(self) -> None:
        driver = _driver()
        if self._host is not None:
            self._staging.release()
            driver.cuMemFreeHost(self._host)
            self._host = None
        if self._base is not None:
            driver.cuIpcCloseMemHandle(self._base)
            self._base = None
        if self._context is not None:
            driver.cuDevicePrimaryCtxRelease(self._device)
            self._context = None


def export_device_segment(start: int, address: int, size: int) -> DeviceSegment:
    """Describe the GPU allocation at ``address`` (from ``cuMemAlloc``, in the current context) holding ring bytes
    ``[start, start + size)``: its CUDA IPC handle, its GPU's PCI bus id, and a dma-buf fd of the range where the
    driver supports dma-buf (the caller closes it once nothing is registered on it; None: register the device
    pointer itself, which needs nvidia-peermem).

    Refuses a GPU that does not order GPUDirect RDMA writes for its own kernels: there, a state word written by the
    NIC could be seen before its payload, and only a host-side ``cuFlushGPUDirectRDMAWrites`` per request (host CPU
    on the request path) would fix it; keep the request side in host memory on such a GPU.
    """
    driver = _driver()
    base, length = _check(driver.cuMemGetAddressRange(address), "cuMemGetAddressRange")
    if int(base) != address or int(length) < device_allocation_size(size):
        raise CudaIpcError(f"device segment {address:#x} (+{size}) is not the base of a cuMemAlloc allocation of at "
                           f"least device_allocation_size({size}) bytes (base {int(base):#x}, {int(length)} bytes): "
                           "CUDA IPC and dma-buf export whole allocations of whole GPU pages")
    device = _check(driver.cuCtxGetDevice(), "cuCtxGetDevice")
    attribute = driver.CUdevice_attribute
    ordering = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
                                                  device), "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WRITES_ORDERING)")
    if ordering == driver.CUGPUDirectRDMAWritesOrdering.CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE:
        raise CudaIpcError("this GPU does not order GPUDirect RDMA writes for its own kernels "
                           "(GPU_DIRECT_RDMA_WRITES_ORDERING = NONE): keep the ring's request side in host memory")
    # Synchronous copies into the ring (the control block at creation) then complete before RDMA can see the range.
    _check(driver.cuPointerSetAttribute(1, driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, address),
           "cuPointerSetAttribute(SYNC_MEMOPS)")
    handle = _check(driver.cuIpcGetMemHandle(address), "cuIpcGetMemHandle").reserved
    bus_id = _check(driver.cuDeviceGetPCIBusId(PCI_BUS_ID_CHARS, device), "cuDeviceGetPCIBusId")
    return DeviceSegment(start=start, size=size, address=address, ipc_handle=bytes(handle),
                         pci_bus_id=_c_string(bus_id), dmabuf_fd=_dmabuf_fd(driver, device, address, size))


def _c_string(raw: bytes) -> str:
    """The text of a C string buffer: what precedes its first NUL (the driver leaves other bytes after it)."""
    return raw.split(b"\0", 1)[0].decode()


def _dmabuf_fd(driver, device, address: int, size: int) -> int | None:
    supported = _check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                                                   device), "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")
    if not supported:
        return None
    kind = driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    size = device_allocation_size(size)
    return int(_check(driver.cuMemGetHandleForAddressRange(address, size, kind, 0), "cuMemGetHandleForAddressRange"))
