"""When requests are sent: ``vllm bench serve``'s arrival process, and the driver that keeps to it.

Arrivals for ``rate`` requests/s: gaps drawn from a gamma distribution of shape ``burstiness`` and mean ``1/rate``
(``burstiness=1``: a Poisson process; < 1 burstier, > 1 more regular, ``inf`` evenly spaced), summed, then scaled so
the last request arrives at ``n / rate`` (as vLLM does, so throughput does not depend on the seed's luck).
``rate=inf`` sends everything at once. ``max_concurrency`` caps the requests in flight; a request past the cap waits
for a free place, so the achieved rate can be lower than ``rate``.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent (non-decreasing; the last is ``n / rate``)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"the request rate and burstiness must be > 0 (got {rate}, {burstiness})")
    if rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist() if n else []


async def send_all(send, requests: list, arrivals: list[float], max_concurrency: int | None = None):
    """Send ``requests[i]`` at ``arrivals[i]`` through ``send`` (an async function of one request returning its
    ``RequestOutput``) and wait for every answer. Returns ``(outputs in request order, duration in seconds)``."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(request, at):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            return await send(request)

    outputs = await asyncio.gather(*(one(r, at) for r, at in zip(requests, arrivals, strict=True)))
    return outputs, time.perf_counter() - start
