"""The scheduler on the GPU: compile, link and load its image, build the graphs, run the loop by device graph launch.

Pipeline (no GPU needed up to ``link_image``):

1. numba compiles the iteration (``scheduler.make_iterate(policy)``) behind a C-ABI entry
   ``int blink_iterate(long long *table)`` to LTO-IR. ``table`` holds ``(address, dim0, dim1)`` for each field of
   ``SchedulerArrays``; the entry rebuilds the arrays from it. The entry's source is generated from the field list,
   so the order the host fills the table in and the order the device reads it cannot drift apart.
2. NVRTC compiles the shim below (graph launches, ``__nanosleep``, the "done" kernel, the stand-in step) to LTO-IR.
3. nvJitLink links both with ``libcudadevrt`` into an sm_90 cubin; the driver loads it.

Launch modes (``SchedulerConfig.launch_mode``), both relaunching the scheduler graph from the device only:

- ``tail``: each scheduler execution runs one iteration, tail-launches the step graph, then itself;
- ``fire_and_forget``: each scheduler execution stays resident for up to 120 steps: iterate, fire-and-forget the
  step graph, wait until the step's last kernel bumps the done counter, repeat; two instantiations of every step
  graph alternate (a graph cannot be relaunched until its previous launch retires). Then it tail-relaunches itself.

When idle, the scheduler sleeps ``idle_sleep_ns`` and relaunches itself. A failing device-side ``cudaGraphLaunch``
is written to the ring's ``launch_error`` and ends the loop; ``join`` raises it by name. The host only starts the
loop and waits for it with a blocking sleep, so it uses no CPU while the loop runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from blink.config import SchedulerConfig
from blink.device.numba_compat import SIMULATOR, cuda
from blink.device.policy import fcfs
from blink.device.ring import CONTROL_DTYPE, RingGeometry, RingLayout
from blink.device.scheduler import make_iterate
from blink.device.standin import STANDIN_CUDA, STANDIN_VOCAB
from blink.device.state import (C64_HEARTBEAT, P_FIRST, PROFILE_PHASES, STATS_WORDS, SchedulerArrays,
                                control_gauges, ring_arrays, state_arrays)
from blink.device.step import StepLayout
from blink.errors import BlinkError
from blink.paths import cache_dir

MAX_BUCKETS = 32
WINDOW = 120                       # fire-and-forget launches per graph execution (a CUDA limit)
LAUNCH_WORDS = 2 * MAX_BUCKETS + 4  # step graphs (two copies), done counter, parity, step profile
DONE, PARITY, STEP_CYCLES, STEPS_TIMED = (2 * MAX_BUCKETS + k for k in range(4))
STOP_CODE = -2

SHIM = r"""
#define MAX_BUCKETS %(max_buckets)d
#define WINDOW %(window)d
#define DONE %(done)d
#define PARITY %(parity)d
#define STEP_CYCLES %(step_cycles)d
#define STEPS_TIMED %(steps_timed)d
#define STOP %(stop)d
#define SHUTDOWN_WORD %(shutdown_word)d
#define SUBMITTED_WORD %(submitted_word)d
#define CANCELS_WORD %(cancels_word)d
extern "C" __device__ int blink_iterate(long long *table);

// clock64() for numba code (declared there with cuda.declare_device, numba's device-function ABI).
extern "C" __device__ int blink_clock(long long *cycles) {
  *cycles = clock64();
  return 0;
}

// Launch a graph from the device; retry briefly (a graph that just signalled may not have retired yet), then
// publish the error to the ring so the host and the agent can see it.
__device__ bool blink_launch(cudaGraphExec_t graph, cudaStream_t how, int *launch_error) {
  cudaError_t e = cudaGraphLaunch(graph, how);
  for (int tries = 0; e != cudaSuccess && tries < 10000; tries++) {
    __nanosleep(100);
    e = cudaGraphLaunch(graph, how);
  }
  if (e == cudaSuccess) return true;
  *(volatile int *)launch_error = (int)e;
  __threadfence_system();
  return false;
}

// One iteration by the whole block; every thread's step inputs are visible device-wide when it returns.
__device__ int blink_step(long long *table) {
  int outcome = blink_iterate(table);
  __threadfence();
  __syncthreads();
  return outcome;
}

extern "C" __global__ void blink_scheduler_tail(long long *table, unsigned long long *launch, int *launch_error,
                                                int idle_ns, const unsigned int *control, long long *doorbells) {
  int outcome = blink_step(table);
  if (threadIdx.x != 0 || outcome == STOP) return;
  if (outcome >= 0) {
    if (!blink_launch((cudaGraphExec_t)launch[outcome], cudaStreamGraphTailLaunch, launch_error)) return;
  } else if (idle_ns > 0) {
    __nanosleep(idle_ns);
  }
  blink_launch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch, launch_error);
}

extern "C" __global__ void blink_scheduler_window(long long *table, unsigned long long *launch, int *launch_error,
                                                  int idle_ns, const unsigned int *control, long long *doorbells) {
  __shared__ int go;
  for (int k = 0; k < WINDOW; k++) {
    int outcome = blink_step(table);
    if (outcome == STOP) return;
    if (threadIdx.x == 0) {
      go = outcome;
      if (outcome >= 0) {
        volatile unsigned long long *done = launch + DONE;
        unsigned long long before = *done, parity = launch[PARITY];
        launch[PARITY] = parity ^ 1ULL;
        cudaGraphExec_t step = (cudaGraphExec_t)launch[parity * MAX_BUCKETS + outcome];
        long long start = clock64();
        if (blink_launch(step, cudaStreamGraphFireAndForget, launch_error)) {
          // Read the agent's words across PCIe while the step runs; the next iteration takes them from here.
          const volatile unsigned int *words = control;
          unsigned int shutdown = words[SHUTDOWN_WORD];
          unsigned long long submitted = *(const volatile unsigned long long *)(words + SUBMITTED_WORD);
          unsigned long long cancels = *(const volatile unsigned long long *)(words + CANCELS_WORD);
          while (*done == before) __nanosleep(32);
          doorbells[1] = shutdown;
          doorbells[2] = (long long)submitted;
          doorbells[3] = (long long)cancels;
          doorbells[0] = 1;
          __threadfence();
          launch[STEP_CYCLES] += clock64() - start;    // launch + step + wake-up, for the profile
          launch[STEPS_TIMED] += 1;
        } else {
          go = STOP;
        }
      }
    }
    __syncthreads();
    if (go == STOP) return;
    if (go < 0) break;
  }
  if (threadIdx.x == 0) {
    if (go < 0 && idle_ns > 0) __nanosleep(idle_ns);
    blink_launch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch, launch_error);
  }
}

// The last kernel of every step graph: tells a resident scheduler that the step's results are in memory.
extern "C" __global__ void blink_done(unsigned long long *launch) {
  __threadfence();
  atomicAdd(launch + DONE, 1ULL);
}
""" % dict(max_buckets=MAX_BUCKETS, window=WINDOW, done=DONE, parity=PARITY, step_cycles=STEP_CYCLES,
           steps_timed=STEPS_TIMED, stop=STOP_CODE, shutdown_word=CONTROL_DTYPE.fields["shutdown"][1] // 4,
           submitted_word=CONTROL_DTYPE.fields["submitted"][1] // 4,
           cancels_word=CONTROL_DTYPE.fields["cancels"][1] // 4) + STANDIN_CUDA


class LaunchError(BlinkError):
    """A CUDA call of the scheduler (host side, or a device-side graph launch) failed."""


# -- 1-3: compile and link (no GPU needed) -------------------------------------------------------------------------


def array_spec() -> list[tuple[str, np.dtype, int]]:
    """(field, dtype, ndim) of every ``SchedulerArrays`` field; sizes do not matter, so a tiny instance tells."""
    geometry = RingGeometry(n_slots=1, max_prompt_tokens=1, max_output_tokens=1, max_stop_ids=1)
    layout = RingLayout(geometry)
    step = StepLayout(max_num_batched_tokens=1, max_num_seqs=1, max_pages_per_seq=1)
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, page_size=1, num_pages=1, max_model_len=1,
                             buckets=(1,))
    arrays = {**ring_arrays(layout.view(bytearray(layout.size))),
              **{name: np.zeros(shape, dtype) for name, (shape, dtype) in step.fields().items()},
              **state_arrays(config, 1, 1, True, step)}
    return [(name, arrays[name].dtype, arrays[name].ndim) for name in SchedulerArrays._fields]


def _entry_function(iterate):
    """``int blink_iterate(long long *table)``: rebuild ``SchedulerArrays`` from the address table, iterate."""
    from numba import types
    from numba.cuda.extending import intrinsic
    from numba.cuda.np.numpy_support import carray

    @intrinsic
    def voidptr(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
        return types.voidptr(types.int64), codegen

    fields = []
    for k, (name, dtype, ndim) in enumerate(array_spec()):
        dims = "".join(f"table[{3 * k + 1 + d}], " for d in range(ndim))
        fields.append(f"carray(voidptr(table[{3 * k}]), ({dims}), np.{dtype.name}),  # {name}")
    source = ("def blink_iterate(table):\n    return iterate(SchedulerArrays(\n        "
              + "\n        ".join(fields) + "\n    ))\n")
    namespace = dict(carray=carray, voidptr=voidptr, np=np, iterate=iterate, SchedulerArrays=SchedulerArrays)
    exec(compile(source, "<blink_iterate>", "exec"), namespace)
    return namespace["blink_iterate"]


@contextlib.contextmanager
def _compile_for(cc):
    """numba-cuda compiles nested device functions for the *current* device; pin the target instead, so the image
    builds the same on a machine with no GPU (CI) as on the H200."""
    import numba.cuda.dispatcher as dispatcher

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = saved


def compile_policy(policy=fcfs, cc=(9, 0)) -> bytes:
    """LTO-IR of the scheduler iteration with ``policy``, behind the C-ABI entry ``blink_iterate``."""
    if SIMULATOR:
        raise LaunchError("the GPU scheduler image cannot be compiled under the CUDA simulator: unset "
                          "NUMBA_ENABLE_CUDASIM (use blink.device.sim on machines without a GPU)")
    from numba import int32, int64, types

    entry = _entry_function(make_iterate(policy))
    with _compile_for(cc):
        ltoir, _ = cuda.compile(entry, int32(types.CPointer(int64)), device=True, abi="c", output="ltoir",
                                cc=cc, abi_info={"abi_name": "blink_iterate"})
    return ltoir


def compile_shim(arch: str = "sm_90") -> bytes:
    """LTO-IR of the CUDA C++ shim (NVRTC)."""
    from cuda.bindings import nvrtc

    program = _nvrtc(nvrtc.nvrtcCreateProgram(SHIM.encode(), b"blink_shim.cu", 0, [], []))
    options = [f"-arch={arch}".encode(), b"-rdc=true", b"-dlto", b"-default-device"]
    result = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
    if int(result) != 0:
        size = _nvrtc(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        raise LaunchError(f"NVRTC failed to compile the scheduler shim:\n{log.decode(errors='replace')}")
    size = _nvrtc(nvrtc.nvrtcGetLTOIRSize(program))
    ltoir = b" " * size
    nvrtc.nvrtcGetLTOIR(program, ltoir)
    return ltoir


def link_image(policy=fcfs, arch: str = "sm_90") -> bytes:
    """The linked cubin: policy + iteration (numba) + shim (NVRTC) + libcudadevrt (nvJitLink).

    Images of blink's own policies are cached under ``$BLINK_CACHE_DIR/scheduler`` by a hash of everything they are
    built from (device sources, toolchain versions, arch): linking takes 15-30 s of every engine start otherwise. A
    user's policy may call device code the hash cannot see, so its image is always rebuilt.
    """
    key = _image_key(policy, arch)
    path = cache_dir() / "scheduler" / f"{key}.cubin" if key else None
    if path is not None and path.exists():
        return path.read_bytes()
    cubin = _link(policy, arch)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(cubin)
        partial.replace(path)                  # atomic: a concurrent start never reads half an image
    return cubin


def _image_key(policy, arch: str) -> str | None:
    from importlib import metadata

    function = getattr(policy, "py_func", policy)
    if function.__module__ != "blink.device.policy":
        return None
    digest = hashlib.sha256(f"{arch} {function.__name__}".encode())
    for dist in ("numba-cuda", "cuda-bindings", "nvidia-nvjitlink", "nvidia-cuda-nvrtc", "nvidia-nvvm"):
        try:
            digest.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist}=?".encode())
    package = Path(__file__).parent
    for source in sorted([*package.glob("*.py"), package.parent / "config.py"]):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:24]


def _link(policy, arch: str) -> bytes:
    import cuda.bindings.nvjitlink as nvjitlink
    from cuda.pathfinder import find_static_lib

    cc = (int(arch[3]), int(arch[4:]))
    policy_ir, shim_ir = compile_policy(policy, cc), compile_shim(arch)
    handle = nvjitlink.create(2, [f"-arch={arch}", "-lto"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, shim_ir, len(shim_ir), "shim")
        nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, policy_ir, len(policy_ir), "policy")
        nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, find_static_lib("cudadevrt"))
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    except nvjitlink.nvJitLinkError as e:
        size = nvjitlink.get_error_log_size(handle)
        log = bytearray(size)
        nvjitlink.get_error_log(handle, log)
        raise LaunchError(f"nvJitLink failed to link the scheduler image: {e}\n{log.decode(errors='replace')}")
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin)


def _nvrtc(result):
    from cuda.bindings import nvrtc

    if int(result[0]) != 0:
        raise LaunchError(f"NVRTC error {nvrtc.nvrtcGetErrorString(result[0])[1].decode()}")
    return result[1] if len(result) == 2 else result[1:]


# -- running it on the GPU -----------------------------------------------------------------------------------------


def _cu(result):
    """Unwrap a cuda.bindings result tuple, raising LaunchError with the error's name."""
    from cuda.bindings import driver, runtime

    code = result[0]
    if int(code) != 0:
        if isinstance(code, runtime.cudaError_t):
            name = runtime.cudaGetErrorName(code)[1].decode()
        else:
            name = driver.cuGetErrorName(code)[1].decode()
        raise LaunchError(f"CUDA call failed: {name}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def cuda_error_name(code: int) -> str:
    from cuda.bindings import runtime

    try:
        return runtime.cudaGetErrorName(runtime.cudaError_t(code))[1].decode()
    except ValueError:
        return f"cudaError {code}"


class GpuScheduler:
    """The persistent scheduler loop on the GPU over a ring in host memory that the GPU reads in place.

    ``memory`` is a page-aligned mapping (``LocalMemory`` or ``SharedMemory``) of an initialised ring; it is
    registered with the GPU for the scheduler's lifetime. ``step_addresses`` maps every ``StepLayout`` field to the
    device address of its buffer (e.g. ``tensor.data_ptr()`` of a CUDA ``StepBuffers``). ``step_graph(bucket_tokens)``
    returns the raw ``cudaGraph_t`` (as an int) of one step for that bucket, reading the step buffers, e.g.
    ``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()`` (keep the torch graph alive); by default, the stand-in
    step. Each is wrapped with the "done" kernel and instantiated twice for device launch.
    """

    def __init__(self, memory, geometry: RingGeometry, config: SchedulerConfig, step_layout: StepLayout,
                 step_addresses: dict[str, int], *, policy=fcfs, step_graph=None, image: bytes | None = None):
        from cuda.bindings import driver

        if len(config.buckets) > MAX_BUCKETS:
            raise ValueError(f"SchedulerConfig.buckets has {len(config.buckets)} sizes; at most {MAX_BUCKETS}")
        self.geometry, self.config, self.step_layout = geometry, config, step_layout
        self.layout = RingLayout(geometry)
        self.running = False
        self._allocations: list = []
        self._ring_host = None
        _cu(driver.cuInit(0))
        self._context = _cu(driver.cuDevicePrimaryCtxRetain(_cu(driver.cuDeviceGet(0))))
        _cu(driver.cuCtxSetCurrent(self._context))
        try:
            self._set_up(memory, step_addresses, policy, step_graph, image)
        except BaseException:
            self.close()                     # a failed start leaves no device memory or registration behind
            raise

    def _set_up(self, memory, step_addresses, policy, step_graph, image) -> None:
        from cuda.bindings import driver

        config, geometry, step_layout = self.config, self.geometry, self.step_layout
        self.stream = _cu(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.module = _cu(driver.cuModuleLoadData(image if image is not None else link_image(policy)))
        self._ring_host, self._ring_device = self._register_ring(memory)
        view = self.layout.view(memory.buffer)
        self.control32 = view.control.view(np.uint32)
        control_gauges(self.control32, config)
        host_state = state_arrays(config, geometry.n_slots, geometry.max_stop_ids, geometry.logprobs, step_layout)
        self.state = {name: self._to_device(array) for name, array in host_state.items()}
        ring = {name: (self._ring_address(array), array.shape) for name, array in ring_arrays(view).items()}
        step = {name: (step_addresses[name], shape) for name, (shape, _) in step_layout.fields().items()}
        self.step_addresses = step_addresses
        self.table = self._to_device(self._address_table({**ring, **step, **self.state}))
        self.launch = self._to_device(np.zeros(LAUNCH_WORDS, np.uint64))
        self.launch_error = self._ring_address(view.control["launch_error"])
        self.step_graphs = self._build_step_graphs(step_graph or self._standin_graph)
        self.scheduler_graph = self._build_scheduler_graph()

    # -- public -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the scheduler graph once; from here on the GPU relaunches it by itself."""
        from cuda.bindings import runtime

        _cu(runtime.cudaGraphLaunch(self.scheduler_graph, runtime.cudaStream_t(init_value=int(self.stream))))
        self.running = True

    def request_shutdown(self) -> None:
        self.control32[CONTROL_DTYPE.fields["shutdown"][1] // 4] = 1

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
                _cu((status,))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler loop did not end within {timeout_s} s")
            time.sleep(poll_s)
        self.running = False
        code = int(np.int32(self.control32[CONTROL_DTYPE.fields["launch_error"][1] // 4]))
        if code:
            raise LaunchError(f"a device-side cudaGraphLaunch failed with {cuda_error_name(code)} ({code})")

    def profile(self) -> dict[str, float]:
        """Microseconds per iteration in each phase (SM clock, thread 0), and per fire-and-forget step launch."""
        from cuda.bindings import driver

        stats = np.zeros(STATS_WORDS, np.int64)
        _cu(driver.cuMemcpyDtoH(stats, self.state["stats"][0], stats.nbytes))
        words = np.zeros(LAUNCH_WORDS, np.uint64)
        _cu(driver.cuMemcpyDtoH(words, self.launch[0], words.nbytes))
        khz = _cu(driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
                                              _cu(driver.cuDeviceGet(0))))
        iterations = max(int(stats[C64_HEARTBEAT]), 1)
        result = {phase: stats[P_FIRST + k] / iterations / khz * 1e3 for k, phase in enumerate(PROFILE_PHASES)}
        result["step_launch_to_done"] = float(words[STEP_CYCLES]) / max(int(words[STEPS_TIMED]), 1) / khz * 1e3
        return result

    def close(self) -> None:
        """Free device memory and unregister the ring (the loop must have ended)."""
        from cuda.bindings import driver

        if self.running:
            raise LaunchError("close() while the scheduler loop runs: request_shutdown() and join() first")
        for allocation in self._allocations:
            driver.cuMemFree(allocation)
        self._allocations.clear()
        if self._ring_host is not None:
            driver.cuMemHostUnregister(self._ring_host)
            self._ring_host = None

    # -- setup ------------------------------------------------------------------------------------------------

    def _register_ring(self, memory):
        from cuda.bindings import driver

        self._ring_bytes = np.frombuffer(memory.buffer, np.uint8)
        host = self._ring_bytes.ctypes.data
        flags = driver.CU_MEMHOSTREGISTER_DEVICEMAP | driver.CU_MEMHOSTREGISTER_PORTABLE
        _cu(driver.cuMemHostRegister(host, memory.size, flags))
        return host, int(_cu(driver.cuMemHostGetDevicePointer(host, 0)))

    def _ring_address(self, array: np.ndarray) -> int:
        return self._ring_device + (array.__array_interface__["data"][0] - self._ring_host)

    def _to_device(self, array: np.ndarray) -> tuple[int, tuple]:
        from cuda.bindings import driver

        address = int(_cu(driver.cuMemAlloc(max(array.nbytes, 8))))
        self._allocations.append(address)
        _cu(driver.cuMemcpyHtoD(address, np.ascontiguousarray(array), array.nbytes))
        return address, array.shape

    @staticmethod
    def _address_table(arrays: dict[str, tuple[int, tuple]]) -> np.ndarray:
        table = np.zeros(3 * len(SchedulerArrays._fields), np.int64)
        for k, name in enumerate(SchedulerArrays._fields):
            address, shape = arrays[name]
            table[3 * k] = address
            table[3 * k + 1: 3 * k + 1 + len(shape)] = shape
        return table

    def _function(self, name: str):
        from cuda.bindings import driver

        return _cu(driver.cuModuleGetFunction(self.module, name.encode()))

    def _launch(self, name: str, grid: int, block: int, args: list[tuple[int, type]]):
        from cuda.bindings import driver

        values = tuple(value for value, _ in args)
        types = tuple(kind for _, kind in args)
        _cu(driver.cuLaunchKernel(self._function(name), grid, 1, 1, block, 1, 1, 0, self.stream,
                                  (values, types), 0))

    def _standin_graph(self, bucket_tokens: int) -> int:
        rows = self.step_layout.sample_rows(bucket_tokens)
        a = self.step_addresses
        args = [(a["logits_indices"], ctypes.c_void_p), (a["token_ids"], ctypes.c_void_p),
                (a["positions"], ctypes.c_void_p), (a["seed"], ctypes.c_void_p), (a["sampled_ids"], ctypes.c_void_p),
                (a["sampled_logprobs"], ctypes.c_void_p), (rows, ctypes.c_int), (STANDIN_VOCAB, ctypes.c_int)]
        return int(self._captured(lambda: self._launch("blink_standin_step", (rows + 127) // 128, 128, args)))

    def _captured(self, enqueue):
        """The graph of what ``enqueue()`` issues on the scheduler's stream."""
        from cuda.bindings import driver

        _cu(driver.cuStreamBeginCapture(self.stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        enqueue()
        return _cu(driver.cuStreamEndCapture(self.stream))

    def _instantiate(self, graph, copies: int = 2) -> list:
        """``copies`` device-launchable, uploaded instantiations of ``graph`` (a step's two alternate)."""
        from cuda.bindings import runtime

        flag = runtime.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
        stream = runtime.cudaStream_t(init_value=int(self.stream))
        execs = []
        for _ in range(copies):
            graph_exec = _cu(runtime.cudaGraphInstantiateWithFlags(runtime.cudaGraph_t(init_value=int(graph)), flag))
            _cu(runtime.cudaGraphUpload(graph_exec, stream))
            execs.append(graph_exec)
        return execs

    def _build_step_graphs(self, step_graph) -> list:
        """Per bucket: [the step's graph] -> [done kernel], instantiated twice; handles go to the launch table."""
        from cuda.bindings import driver

        launch_address = self.launch[0]
        done = self._captured(lambda: self._launch("blink_done", 1, 1, [(launch_address, ctypes.c_void_p)]))
        words = np.zeros(LAUNCH_WORDS, np.uint64)
        graphs = []
        for b, tokens in enumerate(self.config.buckets):
            parent = _cu(driver.cuGraphCreate(0))
            step = driver.CUgraph(init_value=int(step_graph(tokens)))
            step_node = _cu(driver.cuGraphAddChildGraphNode(parent, None, 0, step))
            _cu(driver.cuGraphAddChildGraphNode(parent, [step_node], 1, done))
            first, second = self._instantiate(parent)
            words[b], words[MAX_BUCKETS + b] = int(first), int(second)
            graphs += [first, second]
        _cu(driver.cuMemcpyHtoD(launch_address, words, words.nbytes))
        return graphs

    def _build_scheduler_graph(self):
        kernel = "blink_scheduler_window" if self.config.launch_mode == "fire_and_forget" else "blink_scheduler_tail"
        args = [(self.table[0], ctypes.c_void_p), (self.launch[0], ctypes.c_void_p),
                (self.launch_error, ctypes.c_void_p), (self.config.idle_sleep_ns, ctypes.c_int),
                (self._ring_device, ctypes.c_void_p), (self.state["doorbells"][0], ctypes.c_void_p)]
        (scheduler,) = self._instantiate(
            self._captured(lambda: self._launch(kernel, 1, self.config.block_threads, args)), copies=1)
        return scheduler
