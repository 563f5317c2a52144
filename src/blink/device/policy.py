"""Admission policies: device functions that give each READY request a sort key. Lower keys are admitted first;
equal keys go in slot order.

A policy is plain numba CUDA Python with this signature (all arguments come from the request's ring header)::

    @cuda.jit(device=True)
    def my_policy(arrival_ns, prompt_len, max_tokens, priority, request_id):   # int64, int32, int32, int32, int64
        return <an int64 key>

Pass it to ``make_iterate`` (or ``SimScheduler`` / ``GpuScheduler``) as ``policy=``. It runs once per waiting
request per iteration, on one GPU thread each, so keep it to arithmetic on its arguments.
"""
from __future__ import annotations

from numba import int64

from blink.device.numba_compat import cuda


ARGUMENTS = ("arrival_ns", "prompt_len", "max_tokens", "priority", "request_id")    # a policy's, in this order


@cuda.jit(device=True)
def fcfs(arrival_ns, prompt_len, max_tokens, priority, request_id):
    """First come, first served: by the agent's arrival timestamp (the default, as in vLLM)."""
    return arrival_ns


PRIORITY_LIMIT = 1 << 22


@cuda.jit(device=True)
def by_priority(arrival_ns, prompt_len, max_tokens, priority, request_id):
    """Lower ``priority`` first (vLLM's convention), in submission order within a level.

    The key packs the priority (clamped to +-2**22) above 40 bits of the agent's request counter.
    """
    level = max(min(int64(priority), PRIORITY_LIMIT), -PRIORITY_LIMIT)
    return level * (int64(1) << 40) + (request_id & ((int64(1) << 40) - 1))
