"""CPU backend: the scheduler's device code under numba's CUDA simulator, the model step on the CPU.

The iteration kernel here is built from exactly the device functions the GPU image links (``make_iterate``), so its
observable behaviour is the GPU loop's; only the launch mechanics differ: a Python loop launches one simulated
block per iteration (``ITERATION``, as the GPU's tail loop does) and runs the step between iterations. Import this
module before anything imports numba (it turns the simulator on), or set ``NUMBA_ENABLE_CUDASIM=1`` yourself.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

from blink.device.arrays import (check_history, control_gauges, ring_arrays, state_arrays,  # noqa: E402
                                 zero_history)
from blink.device.config import SchedulerConfig  # noqa: E402
from blink.device.numba_compat import SIMULATOR, cuda  # noqa: E402
from blink.device.policy import fcfs  # noqa: E402
from blink.device.scheduler import make_iterate  # noqa: E402
from blink.device.state import IDLE, ITERATION, STOP, SchedulerArrays  # noqa: E402
from blink.device.step import StepBuffers  # noqa: E402
from blink.ring.geometry import RingGeometry  # noqa: E402
from blink.ring.layout import RingView  # noqa: E402
from blink.ring.standin import standin_step  # noqa: E402

if not SIMULATOR:
    raise ImportError("blink.device.sim needs numba's CUDA simulator, but numba was imported without it: set "
                      "NUMBA_ENABLE_CUDASIM=1 before numba is first imported (or import blink.device.sim first)")

from numba import types as _types  # noqa: E402
from numba.cuda.simulator import kernelapi as _kernelapi  # noqa: E402

_SHARED_LOCK = threading.Lock()


def _shared_array(self, shape, dtype, alignment=None):
    """``cuda.shared.array`` for the simulator, race-free.

    numba's simulator looks up a shared array by the caller's source line and creates it when missing, without a
    lock: two simulated threads reaching the line together can each create their own array, and the block's
    threads then silently stop sharing it. Same lookup here, under a lock (and zero-filled).
    """
    if shape == 0 or alignment is not None:
        raise NotImplementedError("blink's device code uses neither dynamic nor aligned shared memory")
    frame = sys._getframe(1)
    key = (frame.f_code.co_filename, frame.f_lineno)
    with _SHARED_LOCK:
        array = self._allocations.get(key)
        if array is None:
            if isinstance(dtype, _types.Type):
                dtype = np.dtype(str(dtype))
            array = self._allocations[key] = np.zeros(shape, dtype)
    return array


_kernelapi.FakeCUDAShared.array = _shared_array

# The simulator swaps the ``cuda`` global of the modules it runs for the duration of a launch, so two simulated
# launches at once (two CPU schedulers in one process), or building a kernel during a launch, break each other:
# they take turns.
_LAUNCH_LOCK = threading.Lock()


def make_kernel(policy):
    """A one-block kernel that runs parts of a scheduler iteration (``part``) and reports their outcome."""
    with _LAUNCH_LOCK:      # while another scheduler's launch runs, ``cuda`` in these modules is the simulator's
        iterate = make_iterate(policy)

        @cuda.jit
        def scheduler_kernel(s, part, result):
            outcome = iterate(s, part)
            if cuda.threadIdx.x == 0:
                result[0] = outcome

    return scheduler_kernel


@contextlib.contextmanager
def _fast_thread_switching():
    """The simulator's block manager busy-polls its threads; with Python's default 5 ms GIL switch interval every
    barrier costs milliseconds. A short interval makes an iteration ~10x faster."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class SimScheduler:
    """The scheduler loop on the CPU over a ring view. ``step_fn(scheduler_arrays, bucket_tokens)`` runs a step.

    ``threads`` is the simulated block size: each simulated thread is a Python thread, so keep it small; results do
    not depend on it. ``history_tokens`` is the step's token history (the numpy view of the model's
    ``TokenHistory.tokens``, which its step records); by default one of the scheduler's own, which the stand-in step
    records.
    """

    def __init__(self, view: RingView, geometry: RingGeometry, config: SchedulerConfig, step: StepBuffers, *,
                 step_fn=standin_step, policy=fcfs, threads: int = 4, history_tokens: np.ndarray | None = None):
        if threads < 1:
            raise ValueError(f"threads must be >= 1 (got {threads})")
        if history_tokens is None:
            history_tokens = zero_history(config)
        check_history(config, history_tokens.size)
        step_arrays = {name: tensor.numpy() for name, tensor in step.tensors().items()}
        self.arrays = SchedulerArrays(**ring_arrays(view), **step_arrays, history_tokens=history_tokens,
                                      **state_arrays(config, geometry, step.layout,
                                                     int(view.control["prefix_seed"][0])))
        control_gauges(self.arrays.control, config)
        self.config = config
        self.step_fn = step_fn
        self.threads = threads
        self._kernel = make_kernel(policy)
        self._result = np.zeros(1, np.int32)

    def iteration(self, part: int = ITERATION) -> int:
        """One scheduler iteration, then the step it planned. Returns the bucket index, IDLE or STOP.

        ``part`` runs only some parts of it (``blink.device.state``), then the step if PREPARE planned one: PREPARE,
        then SETTLE is the resident GPU loop's order (there, the step runs beside SETTLE, which writes nothing it
        reads). COLLECT or SETTLE alone returns AGAIN or IDLE."""
        # Host work (a simulated iteration, a model step on torch CPU) can outlast the agent's liveness timeout on a
        # loaded machine: ``in_step`` says the loop is inside it (nonzero), moves while it progresses (``progress``),
        # and its return to 0 at the end is itself a beat (blink.nic.liveness).
        self.arrays.control[0].in_step = 1
        try:
            with _LAUNCH_LOCK, _fast_thread_switching():
                self._kernel[1, self.threads](self.arrays, part, self._result)
            outcome = int(self._result[0])
            if outcome >= 0:
                self.step_fn(self.arrays, self.config.buckets[outcome])
        finally:
            self.arrays.control[0].in_step = 0
        return outcome

    def progress(self) -> None:
        """The step made progress (the CPU backend calls it after each model layer): ``in_step`` moves, so a step
        that takes longer than the backend's step limit but keeps moving is not taken for a hung one."""
        self.arrays.control[0].in_step += 1

    def run(self, idle_sleep_s: tuple[float, float] = (1e-3, 50e-3)) -> None:
        """Iterate until shutdown is requested and everything in flight was aborted.

        While idle the sleep between iterations doubles from ``idle_sleep_s[0]`` up to ``idle_sleep_s[1]``; work
        resets it. Once two idle iterations in a row saw the same doorbells (shutdown, submitted, cancels), the
        scheduler is quiescent and a further iteration would change nothing but the heartbeat: until a doorbell
        moves, the loop only beats (``_idle_beat``) instead of simulating a whole iteration (milliseconds of CPU
        each, a Python thread per simulated thread), so an idle engine costs next to nothing.
        """
        shortest, longest = idle_sleep_s
        sleep, idle_bells, quiet_bells = 0.0, None, None
        while True:
            bells = self._doorbells()
            if bells == quiet_bells:
                self._idle_beat()
                outcome = IDLE
            else:
                outcome = self.iteration()
                if outcome == STOP:
                    return
                quiet_bells = bells if outcome == IDLE and bells == idle_bells else None
                idle_bells = bells if outcome == IDLE else None
            sleep = min(max(2 * sleep, shortest), longest) if outcome < 0 else 0.0
            time.sleep(sleep)

    def _doorbells(self) -> tuple[int, int, int]:
        a = self.arrays
        return int(a.control[0].shutdown), int(a.control[0].submitted), int(a.control[0].cancels)

    def _idle_beat(self) -> None:
        """What an iteration of a quiescent scheduler changes: its heartbeat (the device copy and the ring's)."""
        stats = self.arrays.stats[0]
        stats.heartbeat += 1
        self.arrays.control[0].heartbeat = stats.heartbeat
