"""The scheduler image: compile, link and cache the cubin the GPU loop runs (no GPU needed).

1. numba compiles the iteration (``scheduler.make_iterate(policy)``) behind a C-ABI entry
   ``int blink_iterate(long long *table, int part)`` to LTO-IR (``part``: the parts of the iteration to run;
   ``table``: the arrays' address table, ``array_table.py``, read where each array is used). The entry is inlined
   where the shim calls it, so each call keeps only the parts it names and no call saves registers.
2. NVRTC compiles ``shim.cu`` (the device loop, the "done" kernel, the stand-in step) to LTO-IR, after C
   declarations of the records it reads (``SHIM_STRUCTS``: the launch table, written from its dtype by
   ``cstruct.py``), with every constant it shares with Python passed as ``-D`` (``SHIM_DEFINES``).
3. nvJitLink links both with ``libcudadevrt`` into an sm_90 cubin, cached by a hash of everything it is built from.

The launch table (``LAUNCH_DTYPE``, in device memory) is the shim's other input: two instantiations of each
bucket's step graph, the done counter, the parity of the next instantiation, and the step profile.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from blink.device import array_table
from blink.device.config import IMAGE_ARCH, MAX_BUCKETS
from blink.device.cstruct import c_struct
from blink.device.numba_compat import SIMULATOR, cuda
from blink.device.policy import fcfs
from blink.device.scheduler import make_iterate
from blink.device.state import AGAIN, ITERATION, PREPARE, SETTLE, STOP, WATCH
from blink.errors import LaunchError
from blink.paths import cache_dir

SHIM_PATH = Path(__file__).with_name("shim.cu")
WINDOW = 120                        # fire-and-forget launches per graph execution (a CUDA limit)
# The launch table (device memory): two instantiations of each bucket's step graph (a graph cannot be relaunched
# before its last launch retired: the resident loop alternates them), the counter each step's last kernel bumps, the
# parity of the next instantiation, and the step profile (cycles from launch to done, the steps timed).
LAUNCH_DTYPE = np.dtype([("graphs", "<u8", (2, MAX_BUCKETS)), ("done", "<u8"), ("parity", "<u8"),
                         ("step_cycles", "<u8"), ("steps_timed", "<u8")], align=True)
LAUNCH_RETRIES = 10_000             # a graph that just signalled may not have retired yet: retry this often
LAUNCH_RETRY_NS = 100               # ... this long apart
DONE_POLL_NS = 32                   # the resident loop's sleep between looks at the done counter
WATCH_POLL_NS = 500                 # an idle resident loop's sleep between looks at the doorbells (each a PCIe round
                                    # trip, ~1 us, when the ring is in host memory)
STANDIN_BLOCK = 128                 # threads per block of the stand-in step
SHIM_DEFINES = {"WINDOW": WINDOW, "STOP": STOP, "AGAIN": AGAIN, "PREPARE": PREPARE, "SETTLE": SETTLE,
                "WATCH": WATCH, "ITERATION": ITERATION, "LAUNCH_RETRIES": LAUNCH_RETRIES,
                "LAUNCH_RETRY_NS": LAUNCH_RETRY_NS, "DONE_POLL_NS": DONE_POLL_NS, "WATCH_POLL_NS": WATCH_POLL_NS,
                "TABLE_WORDS": array_table.TABLE_WORDS}
# The memory the shim reads and writes, declared in C from the dtypes the Python side uses (cstruct.py).
SHIM_STRUCTS = {"BlinkLaunch": LAUNCH_DTYPE}
# Sources the cached image depends on besides numba, the CUDA toolchain and the policy.
_IMAGE_SOURCES = ("device/*.py", "device/shim.cu", "ring/control.py", "ring/layout.py", "ring/hashing.py")


def _entry_function(policy):
    """``int blink_iterate(long long *table, int part)``: run ``part`` of the iteration on the arrays of the address
    table ``table`` (``array_table.py``)."""
    scheduler_arrays = array_table.register()
    iterate = make_iterate(policy)

    def blink_iterate(table, part):
        return iterate(scheduler_arrays(table), part)
    return blink_iterate


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

    entry = _entry_function(policy)
    with _compile_for(cc):
        ltoir, _ = cuda.compile(entry, int32(types.CPointer(int64), int32), device=True, abi="c", output="ltoir",
                                forceinline=True,
                                cc=cc, abi_info={"abi_name": "blink_iterate"})
    return ltoir


def compile_shim(arch: str = IMAGE_ARCH) -> bytes:
    """LTO-IR of ``shim.cu`` (NVRTC), after the declarations of ``SHIM_STRUCTS``, with ``SHIM_DEFINES``."""
    from cuda.bindings import nvrtc

    source = "".join(c_struct(name, dtype) for name, dtype in SHIM_STRUCTS.items()) + SHIM_PATH.read_text()
    program = _nvrtc(nvrtc.nvrtcCreateProgram(source.encode(), SHIM_PATH.name.encode(), 0, [], []))
    options = [f"-arch={arch}".encode(), b"-rdc=true", b"-dlto", b"-default-device",
               *(f"-D{name}={value}".encode() for name, value in SHIM_DEFINES.items())]
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


def link_image(policy=fcfs, arch: str = IMAGE_ARCH) -> bytes:
    """The linked cubin: policy + iteration (numba) + shim (NVRTC) + libcudadevrt (nvJitLink).

    Images of blink's own policies are cached under ``$BLINK_CACHE_DIR/scheduler`` by a hash of everything they are
    built from (device sources, toolchain versions, arch): linking takes 15-30 s of every engine start otherwise. A
    user's policy may call device code the hash cannot see, so its image is always rebuilt.
    """
    key = _image_key(policy, arch)
    path = cache_dir() / "scheduler" / f"{key}.cubin" if key else None
    if path is not None and path.exists():
        return path.read_bytes()
    cubin, _ = link(policy, arch)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(cubin)
        partial.replace(path)                  # atomic: a concurrent start never reads half an image
    return cubin


def _image_key(policy, arch: str) -> str | None:
    function = getattr(policy, "py_func", policy)
    if function.__module__ != "blink.device.policy":
        return None
    digest = hashlib.sha256(f"{arch} {function.__name__}".encode())
    for dist in ("numba-cuda", "cuda-bindings", "nvidia-nvjitlink", "nvidia-cuda-nvrtc", "nvidia-nvvm"):
        try:
            digest.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist}=?".encode())
    package = Path(__file__).parent.parent
    for source in sorted(path for pattern in _IMAGE_SOURCES for path in package.glob(pattern)):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:24]


def link(policy, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """The cubin (uncached) and nvJitLink's info log; ``options`` are more nvJitLink options (``-verbose``: ptxas's
    registers, stack and spills per function, in the log)."""
    import cuda.bindings.nvjitlink as nvjitlink
    from cuda.pathfinder import find_static_lib

    policy_ir, shim_ir = compile_policy(policy, compute_capability(arch)), compile_shim(arch)
    return link_cubin([f"-arch={arch}", "-lto", *options],
                      [(nvjitlink.InputType.LTOIR, shim_ir, "shim"), (nvjitlink.InputType.LTOIR, policy_ir, "policy"),
                       (nvjitlink.InputType.LIBRARY, find_static_lib("cudadevrt"), "cudadevrt")])


def compute_capability(arch: str) -> tuple[int, int]:
    """``(9, 0)`` for ``"sm_90"``."""
    return int(arch[3]), int(arch[4:])


def link_cubin(flags: list[str], inputs: list[tuple]) -> tuple[bytes, str]:
    """nvJitLink ``inputs`` with ``flags``: the cubin and the info log. An input is ``(nvjitlink.InputType, bytes or
    a file's path, name)``. Raises LaunchError with nvJitLink's error log if it fails."""
    import cuda.bindings.nvjitlink as nvjitlink

    handle = nvjitlink.create(len(flags), flags)
    try:
        for kind, data, name in inputs:
            if isinstance(data, bytes):
                nvjitlink.add_data(handle, kind, data, len(data), name)
            else:
                nvjitlink.add_file(handle, kind, str(data))
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    except nvjitlink.nvJitLinkError as e:
        size = nvjitlink.get_error_log_size(handle)
        log = bytearray(size)
        nvjitlink.get_error_log(handle, log)
        names = ", ".join(name for _, _, name in inputs)
        raise LaunchError(f"nvJitLink failed to link {names}: {e}\n{log.decode(errors='replace')}")
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), log.decode(errors="replace").replace("\0", "")


def _nvrtc(result):
    from cuda.bindings import nvrtc

    if int(result[0]) != 0:
        raise LaunchError(f"NVRTC error {nvrtc.nvrtcGetErrorString(result[0])[1].decode()}")
    return result[1] if len(result) == 2 else result[1:]
