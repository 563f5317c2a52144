"""GPU energy of a benchmark run: board power read through NVML (``nvidia-ml-py``) by a sampling thread.

Energy is the trapezoid integral of the sampled power of every GPU NVML sees, summed over GPUs; joules per output
token divide it by the run's generated tokens. Where there is no NVML (no GPU, no driver, no ``nvidia-ml-py``) the
meter says so in ``reason`` and reports ``available: False``: a benchmark without a GPU is not an error.
"""
from __future__ import annotations

import itertools
import threading
import time


def integrate(samples: list[tuple[float, float]]) -> float:
    """Joules from ``(seconds, watts)`` samples in time order: the trapezoid rule (0 for fewer than two samples)."""
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in itertools.pairwise(samples))


class EnergyMeter:
    """``with EnergyMeter() as meter: ...`` samples total GPU power every ``interval_s`` during the block, including
    at its start and end; then ``meter.result(output_tokens)`` is the JSON record."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self.gpus: list[str] = []
        self.reason: str | None = None
        self._nvml, self._handles, self._stop, self._thread = None, [], threading.Event(), None

    def __enter__(self):
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (the bench extra: pip install 'blink-serve[bench]')"
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:       # no driver, no libnvidia-ml, ...
            self.reason = f"NVML is not available: {e}"
            return self
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.gpus = [pynvml.nvmlDeviceGetName(h) for h in self._handles]
        if not self._handles:
            self.reason = "NVML sees no GPU"
            return self
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        milliwatts = sum(self._nvml.nvmlDeviceGetPowerUsage(h) for h in self._handles)
        self.samples.append((time.perf_counter(), milliwatts / 1e3))

    def result(self, output_tokens: int) -> dict:
        """``{"available", "reason", "gpus", "energy_j", "mean_power_w", "max_power_w", "samples",
        "joules_per_output_token"}`` (numbers ``None`` when unavailable)."""
        if self.reason is not None:
            return {"available": False, "reason": self.reason, "gpus": self.gpus, "energy_j": None,
                    "mean_power_w": None, "max_power_w": None, "samples": 0, "joules_per_output_token": None}
        joules = integrate(self.samples)
        seconds = self.samples[-1][0] - self.samples[0][0]
        return {"available": True, "reason": None, "gpus": self.gpus, "energy_j": joules,
                "mean_power_w": joules / seconds if seconds > 0 else self.samples[0][1],
                "max_power_w": max(w for _, w in self.samples), "samples": len(self.samples),
                "joules_per_output_token": joules / output_tokens if output_tokens else None}
