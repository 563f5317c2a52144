"""The engine's two backends: the scheduler loop and the model step, on the GPU or on the CPU.

Both run the same scheduler device code over the same ring and step buffers (``blink.device.step``); they differ in
where it runs and how the step is launched:

- ``GpuBackend``: model, KV pool and step buffers are CUDA tensors; one step graph per token bucket is captured with
  torch and handed to ``GpuScheduler``, which device-launches them from its persistent loop. The host only starts
  the loop and later stops it.
- ``CpuBackend``: ``SimScheduler`` (the device code under numba's CUDA simulator) in a background thread, the model
  step on torch CPU between its iterations.

numba decides once per process, at its first import, whether the simulator is on (``NUMBA_ENABLE_CUDASIM``): CPU mode
needs it on, GPU mode off. ``select_device`` sets it before numba is imported and refuses a process that already
imported numba the other way.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from blink.config import EngineConfig, SchedulerConfig
from blink.device.ring import RingGeometry
from blink.device.step import StepBuffers, StepLayout
from blink.errors import BlinkError

SHUTDOWN_TIMEOUT_S = 120.0   # a CPU step of a full 2048-token prefill can take seconds


class EngineError(BlinkError):
    """The engine cannot start or run in this process (device, numba mode, scheduler loop)."""


def select_device(requested: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``EngineConfig.device``; puts numba's CUDA simulator in the matching mode."""
    import torch

    device = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("EngineConfig.device='cuda' but torch sees no CUDA GPU: use device='cpu' (or 'auto')")
    simulator = device == "cpu"
    if "numba" in sys.modules:
        from numba import config

        if bool(config.ENABLE_CUDASIM) != simulator:
            mode = "on" if config.ENABLE_CUDASIM else "off"
            raise EngineError(
                f"the {device} engine needs numba's CUDA simulator {'on' if simulator else 'off'}, but this process "
                f"already imported numba with it {mode} (NUMBA_ENABLE_CUDASIM is read once, at numba's first "
                f"import): start the engine in a fresh process with NUMBA_ENABLE_CUDASIM={int(simulator)}, or "
                "create it before anything imports numba")
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = str(int(simulator))
    return device


def scheduler_config(config: EngineConfig, max_model_len: int, num_pages: int, eos_token_ids: tuple[int, ...],
                     budget: str) -> SchedulerConfig:
    """The scheduler's limits; ``ValueError`` naming what to change if the pool cannot hold one longest sequence."""
    need = -(-max_model_len // config.page_size)
    if num_pages < need:
        raise ValueError(
            f"the KV cache holds {num_pages} pages of {config.page_size} tokens, but one sequence of "
            f"max_model_len={max_model_len} tokens needs {need}: give it more memory ({budget}) or lower "
            "EngineConfig.max_model_len")
    return SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                           page_size=config.page_size, num_pages=num_pages, max_model_len=max_model_len,
                           buckets=config.buckets(), eos_token_ids=eos_token_ids, launch_mode=config.launch_mode)


def step_layout(config: EngineConfig, max_model_len: int) -> StepLayout:
    return StepLayout(config.buckets()[-1], config.max_num_seqs, -(-max_model_len // config.page_size))


class CpuBackend:
    """``SimScheduler`` in a background thread; its step runs the model on torch CPU over the step buffers."""

    def __init__(self, model, memory, geometry: RingGeometry, config: EngineConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...], progress):
        from blink.device.ring import RingLayout
        from blink.device.sim import SimScheduler
        from blink.models.memory import kv_page_bytes

        page_bytes = kv_page_bytes(model, config.page_size)
        num_pages = config.num_pages or int(config.cpu_kv_cache_gib * 2**30 // page_bytes)
        if config.num_pages:
            budget = "EngineConfig.num_pages"
        else:
            budget = f"EngineConfig.cpu_kv_cache_gib={config.cpu_kv_cache_gib}"
        self.config = scheduler_config(config, max_model_len, num_pages, eos_token_ids, budget)
        self.model = model
        self.kv = model.allocate_kv_cache(num_pages, config.page_size)
        progress(f"KV cache: {num_pages} pages x {config.page_size} tokens ({num_pages * page_bytes / 2**30:.2f} GiB)")
        self.step = StepBuffers(step_layout(config, max_model_len))
        self._view = RingLayout(geometry).view(memory.buffer)
        self.scheduler = SimScheduler(self._view, geometry, self.config, self.step, step_fn=self._run_step,
                                      threads=config.sim_threads)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="blink-cpu-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """The scheduler loop is still running."""
        return self._thread.is_alive()

    def _run_step(self, arrays, bucket_tokens: int) -> None:
        # The CPU step needs no fixed shapes (nothing is captured), so it runs the planned tokens, not the bucket.
        n_tokens = int(arrays.query_start_loc[int(arrays.num_seqs[0])])
        self.model(self.step, self.kv, n_tokens)

    def _loop(self) -> None:
        from blink.device.ring import ENGINE_STOPPED

        try:
            self.scheduler.run()
        except BaseException as e:  # surfaced by Engine (the agent then sees the engine stopped)
            self.error = e
            self._view.control["engine_state"] = ENGINE_STOPPED

    def join(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Wait for the loop to end (after shutdown was requested through the ring)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise EngineError(f"the CPU scheduler thread did not stop within {timeout_s:.0f} s")

    def close(self) -> None:
        self.join()
        self.scheduler = self._view = self.step = self.kv = self.model = None


class GpuBackend:
    """Torch-captured step graphs per bucket, device-launched by ``GpuScheduler`` from its persistent loop."""

    def __init__(self, model, memory, geometry: RingGeometry, config: EngineConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...], progress):
        import torch

        from blink.device.launch import GpuScheduler, link_image
        from blink.models.memory import kv_page_bytes

        self.model = model
        self.step = StepBuffers(step_layout(config, max_model_len), "cuda")
        page_bytes = kv_page_bytes(model, config.page_size)
        if config.num_pages:
            num_pages, budget = config.num_pages, "EngineConfig.num_pages"
        else:
            num_pages = self._pages_that_fit(config, page_bytes)
            budget = f"EngineConfig.gpu_memory_utilization={config.gpu_memory_utilization}"
        self.config = scheduler_config(config, max_model_len, num_pages, eos_token_ids, budget)
        self.kv = model.allocate_kv_cache(num_pages, config.page_size)
        progress(f"KV cache: {num_pages} pages x {config.page_size} tokens ({num_pages * page_bytes / 2**30:.2f} GiB)")
        started = time.monotonic()
        self.graphs = self._capture(self.config.buckets)
        progress(f"captured {len(self.graphs)} step graphs ({self.config.buckets[0]}..{self.config.buckets[-1]} "
                 f"tokens) in {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        image = link_image()
        progress(f"compiled and linked the scheduler in {time.monotonic() - started:.1f} s")
        addresses = {name: tensor.data_ptr() for name, tensor in self.step.tensors().items()}
        torch.cuda.synchronize()
        self.scheduler = GpuScheduler(memory, geometry, self.config, self.step.layout, addresses,
                                      step_graph=lambda tokens: self.graphs[tokens].raw_cuda_graph(), image=image)
        self.error: BaseException | None = None

    def _pages_that_fit(self, config: EngineConfig, page_bytes: int) -> int:
        """KV pages that fit in ``gpu_memory_utilization`` of the GPU, after one step of the largest bucket.

        Weights and step buffers are already allocated; the largest step's activations are measured by running it
        once (on padding only, with a one-page pool), since its captured graph will hold that much in its pool.
        """
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.model(self.step, self.model.allocate_kv_cache(1, config.page_size), config.buckets()[-1])
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = config.gpu_memory_utilization * total - (total - free) - activations
        return max(int(budget // page_bytes), 0)

    def _capture(self, buckets: tuple[int, ...]) -> dict:
        """One ``CUDAGraph(keep_graph=True)`` per bucket, sharing one memory pool (steps never run concurrently).

        Warm-up runs first on the capture stream (Triton compiles its kernels there); then the largest bucket is
        captured first, so the shared pool is sized by it. The step buffers hold padding only (slot_mapping -1,
        logits_indices -1), so neither warm-up nor capture writes the KV pool or sampled ids.
        """
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tokens in buckets:
                self.model(self.step, self.kv, tokens)
        stream.synchronize()
        pool = torch.cuda.graph_pool_handle()
        graphs = {}
        for tokens in reversed(buckets):
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.model(self.step, self.kv, tokens)
            graphs[tokens] = graph
        return graphs

    def start(self) -> None:
        self.scheduler.start()

    def alive(self) -> bool:
        """The scheduler loop is still running (its stream has work)."""
        from cuda.bindings import driver

        return driver.cuStreamQuery(self.scheduler.stream)[0] == driver.CUresult.CUDA_ERROR_NOT_READY

    def join(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Wait for the loop to end (after shutdown was requested through the ring); raise its launch error."""
        if self.scheduler.running:
            self.scheduler.join(timeout_s)

    def close(self) -> None:
        import torch

        try:
            self.join()
        finally:
            if not self.scheduler.running:
                self.scheduler.close()
            self.scheduler = self.graphs = self.kv = self.step = self.model = None
            torch.cuda.empty_cache()
