"""The iteration's phase profile: thread 0's SM cycles in each phase (``PHASE``), kept in shared memory between
phases (``lap``) and added to ``s.stats[0].profile`` once where a part of the iteration ends (``add_laps``).

Invariant: every phase of a part is lapped on every path through it (a phase with nothing to do laps ~0 cycles), so
``add_laps`` never adds a lap left from an earlier iteration."""
from __future__ import annotations

from blink.device.numba_compat import clock, cuda


@cuda.jit(device=True)
def lap(sh, start, phase):
    """Thread 0: ``sh.cycles[phase]`` = the cycles since ``start``; return the new start. Shared memory between
    phases, the profile once where the part ends (``add_laps``): a load and store of the profile after each phase
    would hold thread 0, and the block's next barrier, a round trip each."""
    now = clock()
    if cuda.threadIdx.x == 0:
        sh.cycles[phase] = now - start
    return now


@cuda.jit(device=True)
def add_laps(s, sh, first, end):
    """Thread 0, where a part ends: what its phases ``first .. end - 1`` took into the profile, in one batch."""
    profile = s.stats[0].profile
    for k in range(first, end):
        profile[k] += sh.cycles[k]
