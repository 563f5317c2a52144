"""``GpuScheduler``: the scheduler's persistent loop on the GPU, relaunched by device graph launch.

Launch modes (``SchedulerConfig.launch_mode``), both relaunching the scheduler graph from the device only:

- ``tail``: each scheduler execution runs one iteration (``scheduler.py``), tail-launches the step graph, then
  itself;
- ``fire_and_forget``: each scheduler execution stays resident for up to ``image.WINDOW`` steps: prepare,
  fire-and-forget the step graph, settle while it runs, wait until the step's last kernel bumps the done counter,
  repeat. Then it tail-relaunches itself.

When idle (nothing to run; resident: and settle left no work, ``AGAIN``), the tail loop sleeps ``idle_sleep_ns`` and
relaunches itself; the resident loop watches the doorbells for up to ``idle_sleep_ns``, still resident, and iterates
again as soon as one moves. A failing device-side ``cudaGraphLaunch``
is written to the ring's ``launch_error`` and ends the loop; ``join`` raises it by name. The host only starts the
loop and waits for it with a blocking sleep, so it uses no CPU while the loop runs.

Ring placement (``request_side``): ``host`` (default) reads the whole ring in place in host memory, across PCIe.
``device`` keeps the request side (control block, status, headers, prompts: what the scheduler polls and scans) in
GPU memory, where those reads are cheap, and the output side in host memory, where the agent reads it. The layout
stays one byte-addressed contract: the scheduler's addresses are the ring's offsets into the two allocations, and
``ring_memory`` is the ring as one ``RemoteMemory`` for this process; agents in other processes reach the request
side through ``ipc_handle`` (CUDA IPC) or a dma-buf of it (RDMA), as a NIC would.
"""
from __future__ import annotations

import ctypes
import time
from functools import partial

import numpy as np

from blink.device import array_table, graphs
from blink.device.config import SchedulerConfig
from blink.device.driver import DeviceMemory, check, error_name
from blink.device.image import LAUNCH_DTYPE, STANDIN_BLOCK, link_image
from blink.device.policy import fcfs
from blink.device.arrays import check_history, control_gauges, ring_arrays, state_arrays, zero_history
from blink.device.state import PHASE, PROFILE_PHASES, STATS_DTYPE
from blink.device.step import StepLayout
from blink.errors import LaunchError
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.split import REQUEST_SIDES, SplitMemory, Window, device_allocation_size, request_side_bytes
from blink.ring.standin import STANDIN_VOCAB


class GpuScheduler:
    """The persistent scheduler loop on GPU ``device`` over a ring in host memory that the GPU reads in place.

    ``memory`` is a page-aligned mapping (``LocalMemory`` or ``SharedMemory``) of an initialised ring; it is
    registered with the GPU for the scheduler's lifetime. ``step_addresses`` maps every ``StepLayout`` field to the
    device address of its buffer (e.g. ``tensor.data_ptr()`` of a CUDA ``StepBuffers``). ``step_graph(bucket_tokens,
    arrays)`` returns the raw ``cudaGraph_t`` (as an int) of one step for that bucket, reading the step buffers, e.g.
    ``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()`` (keep the torch graph alive); by default, the stand-in
    step. Each is wrapped with the "done" kernel and instantiated twice for device launch (``graphs``). It is called
    once the ring is registered: ``arrays`` maps each ring array of ``ring_arrays``, each array of the scheduler's
    state and ``history_tokens`` to its ``(device address, shape)``, for a step that reads or writes one (the grammar
    mirror; the token history). ``history_tokens`` is the step's token history, ``(device address, tokens)`` of the
    model's ``TokenHistory.tokens``; by default a zeroed one of the scheduler's own, which the stand-in step records
    into as a model step does.
    """

    def __init__(self, memory, geometry: RingGeometry, config: SchedulerConfig, step_layout: StepLayout,
                 step_addresses: dict[str, int], *, policy=fcfs, step_graph=None, image: bytes | None = None,
                 device: int = 0, request_side: str = "host", history_tokens: tuple[int, int] | None = None):
        from cuda.bindings import driver

        if request_side not in REQUEST_SIDES:
            raise ValueError(f"GpuScheduler request_side must be one of {REQUEST_SIDES} (got {request_side!r})")
        self.geometry, self.config, self.step_layout = geometry, config, step_layout
        self.memory, self.device, self.request_side = memory, device, request_side
        self.layout = RingLayout(geometry)
        self.running = False
        self._allocations: list = []
        self._ring_host = None
        # The request side's GPU allocation and its size in ring bytes (0 and 0 with request_side="host").
        self.request_bytes = self.request_address = 0
        self.ring_memory = memory
        check(driver.cuInit(0))
        self._context = check(driver.cuDevicePrimaryCtxRetain(check(driver.cuDeviceGet(device))))
        check(driver.cuCtxSetCurrent(self._context))
        try:
            self._set_up(memory, step_addresses, policy, step_graph, image, history_tokens)
        except BaseException:
            self.close()                     # a failed start leaves no device memory or registration behind
            raise

    def _set_up(self, memory, step_addresses, policy, step_graph, image, history_tokens) -> None:
        from cuda.bindings import driver

        config, geometry, step_layout = self.config, self.geometry, self.step_layout
        self.stream = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.module = check(driver.cuModuleLoadData(image if image is not None else link_image(policy)))
        self._check_block_threads()
        self._ring_host, self._ring_device = self._register_ring(memory)
        view = self.layout.view(memory.buffer)
        control_gauges(view.control, config)
        self._place_request_side(memory)
        host_state = state_arrays(config, geometry, step_layout, int(view.control["prefix_seed"][0]))
        self.state = {name: self._to_device(array) for name, array in host_state.items()}
        ring = {name: (self._ring_address(array), array.shape) for name, array in ring_arrays(view).items()}
        step = {name: (step_addresses[name], shape) for name, (shape, _) in step_layout.fields().items()}
        self.step_addresses = step_addresses
        if history_tokens is None:
            history = self._to_device(zero_history(config))
        else:
            check_history(config, history_tokens[1])
            history = (history_tokens[0], (history_tokens[1],))
        self.table = self._to_device(array_table.table({**ring, **step, "history_tokens": history, **self.state}))
        self.launch = self._to_device(np.zeros(1, LAUNCH_DTYPE))
        self.launch_error = self._ring_address(view.control["launch_error"])
        done = graphs.captured(self.stream, lambda: self._launch("blink_done", 1, 1,
                                                                 [(self.launch[0], ctypes.c_void_p)]))
        table, self.step_graphs = graphs.launch_table(config.buckets, partial(step_graph or self._standin_graph,
                                                                              arrays={**ring, **self.state,
                                                                                      "history_tokens": history}),
                                                            done, self.stream)
        check(driver.cuMemcpyHtoD(self.launch[0], table, table.nbytes))
        self.scheduler_graph = self._build_scheduler_graph()

    # -- public -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the scheduler graph once; from here on the GPU relaunches it by itself."""
        from cuda.bindings import runtime

        check(runtime.cudaGraphLaunch(self.scheduler_graph, runtime.cudaStream_t(init_value=int(self.stream))))
        self.running = True

    def request_shutdown(self) -> None:
        control.request_shutdown(self.ring_memory)

    def alive(self) -> bool:
        """The loop's stream still has work (the loop runs)."""
        from cuda.bindings import driver

        return driver.cuStreamQuery(self.stream)[0] == driver.CUresult.CUDA_ERROR_NOT_READY

    def join(self, timeout_s: float | None = None, poll_s: float = 0.01) -> None:
        """Sleep until the loop has ended; raise ``LaunchError`` if it ended on a failed device-side launch."""
        from cuda.bindings import driver

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = driver.cuStreamQuery(self.stream)[0]
            if status == driver.CUresult.CUDA_SUCCESS:
                break
            if status != driver.CUresult.CUDA_ERROR_NOT_READY:
                self.running = False        # the loop died with the context; close() may free what is left
                check((status,))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler loop did not end within {timeout_s} s")
            time.sleep(poll_s)
        self.running = False
        code = control.read(self.ring_memory)["launch_error"]
        if code:
            raise LaunchError(f"a device-side cudaGraphLaunch failed with {error_name(code)} ({code})")

    def cycles(self) -> dict[str, int]:
        """The profile's sums so far, read while the loop runs or after: ``iterations`` (the heartbeat), the SM
        cycles of thread 0 in each phase (``PROFILE_PHASES``, added where each part of an iteration ends), and
        ``step_launch_to_done``, the cycles of ``steps_timed`` fire-and-forget steps from launch until the loop saw
        them done (stored where a resident execution ends)."""
        from cuda.bindings import driver

        stats = np.zeros(1, STATS_DTYPE)
        check(driver.cuMemcpyDtoH(stats, self.state["stats"][0], stats.nbytes))
        stats = stats[0]
        launch = np.zeros(1, LAUNCH_DTYPE)
        check(driver.cuMemcpyDtoH(launch, self.launch[0], launch.nbytes))
        return {"iterations": int(stats.heartbeat), **{phase: int(stats.profile[k]) for phase, k in
                                                         zip(PROFILE_PHASES, PHASE)},
                "step_launch_to_done": int(launch["step_cycles"][0]), "steps_timed": int(launch["steps_timed"][0])}

    def clock_khz(self) -> int:
        """The SM clock ``cycles`` counts in, kHz."""
        from cuda.bindings import driver

        return check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
                                                 check(driver.cuDeviceGet(self.device))))

    def profile(self) -> dict[str, float]:
        """Microseconds per iteration in each phase (SM clock, thread 0), and per fire-and-forget step from its launch
        until the loop saw it done (settle runs in between: ``SETTLE_PHASES`` overlap it)."""
        raw, us = self.cycles(), 1e3 / self.clock_khz()
        iterations = max(raw["iterations"], 1)
        result = {phase: raw[phase] / iterations * us for phase in PROFILE_PHASES}
        result["step_launch_to_done"] = raw["step_launch_to_done"] / max(raw["steps_timed"], 1) * us
        return result

    def close(self) -> None:
        """Free device memory and unregister the ring (the loop must have ended)."""
        from cuda.bindings import driver

        if self.running:
            raise LaunchError("close() while the scheduler loop runs: request_shutdown() and join() first")
        if self.ring_memory is not self.memory:
            self.ring_memory.segments[0][1].close()       # the pinned staging of the request side's view
            self.ring_memory = self.memory
        for allocation in self._allocations:
            driver.cuMemFree(allocation)
        self._allocations.clear()
        if self._ring_host is not None:
            driver.cuMemHostUnregister(self._ring_host)
            self._ring_host = None

    # -- setup ------------------------------------------------------------------------------------------------

    def _place_request_side(self, memory) -> None:
        """With ``request_side="device"``: the ring's first ``request_side_bytes`` move to a GPU allocation
        (initialised from ``memory``), and ``ring_memory`` routes there; else the ring stays all in ``memory``.

        The GPU copy is the live one from here on, and starts as a ring whose engine is starting, whatever the host
        copy says (its creator may have marked it ``ENGINE_ELSEWHERE`` for agents that open it by name)."""
        self.ipc_handle = None
        if self.request_side == "host":
            return
        self.request_bytes = split = request_side_bytes(self.layout)
        from cuda.bindings import driver

        base = int(check(driver.cuMemAlloc(device_allocation_size(split))))
        self._allocations.append(base)
        check(driver.cuMemcpyHtoD(base, np.frombuffer(memory.buffer, np.uint8, split), split))
        self.request_address = base
        self.ipc_handle = bytes(check(driver.cuIpcGetMemHandle(base)).reserved)
        self.ring_memory = SplitMemory([(0, DeviceMemory(base, split)),
                                        (split, Window(memory, split, memory.size - split))])
        control.write(self.ring_memory, "engine_state", control.ENGINE_STARTING)

    def _register_ring(self, memory):
        from cuda.bindings import driver

        self._ring_bytes = np.frombuffer(memory.buffer, np.uint8)
        host = self._ring_bytes.ctypes.data
        flags = driver.CU_MEMHOSTREGISTER_DEVICEMAP | driver.CU_MEMHOSTREGISTER_PORTABLE
        check(driver.cuMemHostRegister(host, memory.size, flags))
        return host, int(check(driver.cuMemHostGetDevicePointer(host, 0)))

    def _ring_address(self, array: np.ndarray) -> int:
        """The device address of a ring array (a view of the host mapping): by its ring offset, in the GPU
        allocation of the request side or in the registered host mapping."""
        offset = array.__array_interface__["data"][0] - self._ring_host
        return self.request_address + offset if offset < self.request_bytes else self._ring_device + offset

    def _to_device(self, array: np.ndarray) -> tuple[int, tuple]:
        from cuda.bindings import driver

        address = int(check(driver.cuMemAlloc(max(array.nbytes, 8))))
        self._allocations.append(address)
        check(driver.cuMemcpyHtoD(address, np.ascontiguousarray(array), array.nbytes))
        return address, array.shape

    def _launch(self, name: str, grid: int, block: int, args: list[tuple[int, type]]):
        from cuda.bindings import driver

        function = check(driver.cuModuleGetFunction(self.module, name.encode()))
        values = tuple(value for value, _ in args)
        types = tuple(kind for _, kind in args)
        check(driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, self.stream, (values, types), 0))

    def _standin_graph(self, bucket_tokens: int, arrays: dict) -> int:     # the stand-in records the token history
        rows = self.step_layout.sample_rows(bucket_tokens)
        a = self.step_addresses
        args = [(a["logits_indices"], ctypes.c_void_p), (a["token_ids"], ctypes.c_void_p),
                (a["positions"], ctypes.c_void_p), (a["slot_mapping"], ctypes.c_void_p), (a["seed"], ctypes.c_void_p),
                (a["sampled_ids"], ctypes.c_void_p), (a["sampled_logprobs"], ctypes.c_void_p),
                (arrays["history_tokens"][0], ctypes.c_void_p), (bucket_tokens, ctypes.c_int), (rows, ctypes.c_int),
                (STANDIN_VOCAB, ctypes.c_int)]
        grid = -(-max(rows, bucket_tokens) // STANDIN_BLOCK)
        return int(graphs.captured(self.stream,
                                   lambda: self._launch("blink_standin_step", grid, STANDIN_BLOCK, args)))

    @property
    def _kernel(self) -> str:
        return "blink_scheduler_window" if self.config.launch_mode == "fire_and_forget" else "blink_scheduler_tail"

    def _check_block_threads(self) -> None:
        """A block of ``block_threads`` must fit the scheduler kernel's registers on this GPU (a launch would fail
        later with a bare "too many resources requested")."""
        from cuda.bindings import driver

        attribute = driver.CUfunction_attribute
        function = check(driver.cuModuleGetFunction(self.module, self._kernel.encode()))
        most = check(driver.cuFuncGetAttribute(attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function))
        if self.config.block_threads > most:
            registers = check(driver.cuFuncGetAttribute(attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function))
            raise LaunchError(f"SchedulerConfig.block_threads={self.config.block_threads} is more than the scheduler "
                              f"kernel can launch with on this GPU ({most}: it uses {registers} registers per "
                              f"thread); use block_threads <= {most}")

    def _build_scheduler_graph(self):
        kernel = self._kernel
        args = [(self.table[0], ctypes.c_void_p), (self.launch[0], ctypes.c_void_p),
                (self.launch_error, ctypes.c_void_p), (self.config.idle_sleep_ns, ctypes.c_int)]
        (scheduler,) = graphs.instantiate(
            graphs.captured(self.stream, lambda: self._launch(kernel, 1, self.config.block_threads, args)), self.stream,
            copies=1)
        return scheduler
