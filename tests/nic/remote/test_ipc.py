"""The CUDA IPC foreign writer: what it says without a driver (here), and on a GPU (``@pytest.mark.gpu``, skipped
elsewhere) a process that is not the engine writing and reading a ring allocated in the engine's GPU memory."""
import ctypes.util
import multiprocessing as mp

import pytest

from blink.errors import CudaIpcError
from blink.nic.remote.ipc import CudaIpcMemory, export_device_segment
from blink.nic.remote.wire import CudaRegion
from blink.ring.split import device_allocation_size
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import READY, RingLayout

GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=16, max_output_tokens=32, max_stop_ids=2)


def test_without_the_nvidia_driver_the_error_says_where_ipc_works():
    if ctypes.util.find_library("cuda"):
        pytest.skip("the NVIDIA driver is installed here")
    with pytest.raises(CudaIpcError, match="NVIDIA driver is not installed here.*--transport rdma"):
        CudaIpcMemory(bytes(64), 4096, "0000:1b:00.0")


@pytest.fixture
def device_ring():
    """A fresh ring allocated with cuMemAlloc in this process (the engine's role), exported."""
    from cuda.bindings import driver

    from blink.nic.remote.ipc import _check

    _check(driver.cuInit(0), "cuInit")
    context = _check(driver.cuDevicePrimaryCtxRetain(_check(driver.cuDeviceGet(0), "cuDeviceGet")), "retain")
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    layout = RingLayout(GEOMETRY)
    address = int(_check(driver.cuMemAlloc(device_allocation_size(layout.size)), "cuMemAlloc"))
    _check(driver.cuMemsetD8(address, 0, layout.size), "cuMemsetD8")
    block = layout.control_bytes()
    _check(driver.cuMemcpyHtoD(address, block, len(block)), "cuMemcpyHtoD")
    segment = export_device_segment(0, address, layout.size)

    def device_bytes(offset, nbytes):
        out = bytearray(nbytes)
        _check(driver.cuMemcpyDtoH(out, address + offset, nbytes), "cuMemcpyDtoH")
        return bytes(out)

    yield layout, segment, device_bytes
    _check(driver.cuMemFree(address), "cuMemFree")


def _submit_from_another_process(handle, size, bus_id, queue):
    """The foreign writer: an agent in a process of its own submits one request into the device ring."""
    from blink.nic.agent import Agent
    from blink.ring.request import SamplingParams

    memory = CudaIpcMemory(handle, size, bus_id)
    agent = Agent.attach(memory)
    queue.put(agent.submit([11, 12, 13], SamplingParams(max_tokens=5, seed=4)))
    memory.close()


@pytest.mark.gpu
def test_the_export_carries_an_ipc_handle_and_a_dmabuf_fd(device_ring):
    layout, segment, _ = device_ring
    assert len(segment.ipc_handle) == 64
    CudaRegion(segment.start, segment.size, segment.ipc_handle, segment.pci_bus_id)    # the handshake's check
    assert segment.dmabuf_fd is not None and segment.dmabuf_fd >= 0, "the H200 reports DMA_BUF_SUPPORTED=1"
    with pytest.raises(CudaIpcError, match="not the base of a cuMemAlloc allocation"):
        export_device_segment(0, segment.address + 4096, 4096)


@pytest.mark.gpu
def test_an_agent_in_another_process_publishes_a_request_into_gpu_memory(device_ring):
    layout, segment, device_bytes = device_ring
    queue = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=_submit_from_another_process,
                                            args=(segment.ipc_handle, layout.size, segment.pci_bus_id, queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 1
    state = int.from_bytes(device_bytes(layout.status_at("state", 0), 4), "little")
    prompt = device_bytes(layout.prompt_at(0), 12)
    assert state == READY and prompt == b"".join(t.to_bytes(4, "little") for t in (11, 12, 13))
    submitted = device_bytes(control.offset_of("submitted"), 8)
    assert int.from_bytes(submitted, "little") == 1, "the doorbell after the state word"
