"""Drive single scheduler phases (waiting.py, batcher.py) under the CUDA simulator, outside ``iterate``.

``scheduler_arrays`` builds a ``SchedulerArrays`` of numpy arrays (the step buffers too, without torch) over a ring
in a plain buffer (a phase kernel takes its shared arrays from ``blink.device.scheduler.scratch``); ``launch`` runs
a one-block kernel with the short GIL switch interval that ``blink.device.sim`` uses (the simulator busy-polls its
threads at every barrier).
"""
from __future__ import annotations

import numpy as np

from blink.device import sim  # noqa: F401  (simulator first, and its race-free shared arrays)
from blink.device.numba_compat import cuda
from blink.device.arrays import ring_arrays, state_arrays, zero_history
from blink.device.state import N_COUNTERS, SchedulerArrays
from blink.device.step import StepLayout
from blink.ring.layout import RingLayout

GARBAGE = 777       # step buffers are filled with it before a plan: whatever the plan leaves there was not written


def scheduler_arrays(geometry, config):
    """(ring view, SchedulerArrays) for a fresh ring of ``geometry`` and fresh scheduler state for ``config``."""
    layout = RingLayout(geometry)
    buffer = bytearray(layout.size)
    view = layout.view(buffer)
    step = StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq)
    step_arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in step.fields().items()}
    s = SchedulerArrays(**ring_arrays(view), **step_arrays, history_tokens=zero_history(config),
                        **state_arrays(config, geometry, step, int(view.control["prefix_seed"][0])))
    return view, s


def fill_step_buffers(s, value=GARBAGE, persistent=False):
    """Overwrite the step inputs the planner writes every step, so a check can tell written words from left-overs.

    Block-table rows and a row's sampling parameters persist between steps (a row only gets the entries it lacks,
    and the parameters when it holds another request: ``row_slot`` / ``row_version`` / ``row_pages``), so they are
    overwritten only when asked (``persistent``), while those words say that no row holds anything.
    """
    names = ("num_seqs", "token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices")
    kept = ("block_tables", "temperature", "top_p", "top_k", "seed", "prompt_lens", "penalties")
    for name in names + (kept if persistent else ()):
        getattr(s, name)[...] = value


@cuda.jit(device=True)
def save_counters(sh, out):
    """Copy the iteration's K_* counters to ``out`` (global memory) after a barrier. All threads."""
    cuda.syncthreads()
    for k in range(cuda.threadIdx.x, N_COUNTERS, cuda.blockDim.x):
        out[k] = sh.counters[k]
    cuda.syncthreads()


def launch(kernel, threads, *args):
    """One block of ``threads`` simulated threads."""
    with sim._LAUNCH_LOCK, sim._fast_thread_switching():
        kernel[1, threads](*args)
