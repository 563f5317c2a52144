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

import logging
import os
import sys
import threading
import time
from dataclasses import astuple
from functools import partial

from blink.config import EngineConfig
from blink.device.config import IMAGE_ARCH, IMAGE_CC, SchedulerConfig
from blink.device.step import StepBuffers, StepLayout
from blink.errors import EngineError
from blink.ring.geometry import RingGeometry

SHUTDOWN_TIMEOUT_S = 120.0   # a CPU step of a full 2048-token prefill can take seconds
GPU_STEP_LIMIT_S = 10        # a GPU step takes milliseconds; one that has not ended after this is hung
CPU_FLOPS_FLOOR = 2e9        # the slowest CPU a step is expected on (a loaded 2-core box: 14-46 GFLOP/s measured)
log = logging.getLogger("blink")


def select_device(requested: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``EngineConfig.device``; puts numba's CUDA simulator in the matching mode."""
    import torch

    device = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("EngineConfig.device='cuda' but torch sees no CUDA GPU: use device='cpu' (or 'auto')")
    if device == "cuda":
        check_capability(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
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


def check_capability(name: str, capability: tuple[int, int]) -> None:
    """``EngineError`` unless a GPU of ``capability`` loads the scheduler image: before the model loads, rather than
    a CUDA error once it has."""
    if capability[0] != IMAGE_CC[0] or capability[1] < IMAGE_CC[1]:
        raise EngineError(f"the GPU engine's scheduler is built for compute capability {IMAGE_CC[0]}.{IMAGE_CC[1]} "
                          f"({IMAGE_ARCH}: H100, H200, GH200) only, and {name} is {capability[0]}.{capability[1]}: "
                          "serve on the CPU (device='cpu', --device cpu); docs/gpu.md says why")


def scheduler_config(config: EngineConfig, max_model_len: int, num_pages: int, eos_token_ids: tuple[int, ...],
                     budget: str) -> SchedulerConfig:
    """``config.scheduler`` resolved for this model and pool; ``ValueError`` naming what to change if the pool
    cannot hold one longest sequence."""
    page_size = config.scheduler.page_size
    need = -(-max_model_len // page_size)
    if num_pages >= 2**31:
        raise ValueError(f"the KV cache would hold {num_pages} pages, beyond the 2**31 - 1 the scheduler's int32 "
                         f"page numbers reach: give it less memory ({budget})")
    if num_pages < need:
        raise ValueError(
            f"the KV cache holds {num_pages} pages of {page_size} tokens, but one sequence of "
            f"max_model_len={max_model_len} tokens needs {need}: give it more memory ({budget}) or lower "
            "SchedulerConfig.max_model_len")
    return config.scheduler.resolve(num_pages=num_pages, max_model_len=max_model_len, eos_token_ids=eos_token_ids)


def step_layout(config: SchedulerConfig, max_model_len: int, geometry: RingGeometry) -> StepLayout:
    """The step buffers' sizes: the largest bucket, every running sequence, one longest sequence's pages, the ring's
    logit biases and top logprobs; a decoding sequence's token and the drafts it may verify."""
    drafts = config.speculative.num_speculative_tokens if config.speculative else 0
    return StepLayout(config.buckets[-1], config.max_num_seqs, -(-max_model_len // config.page_size),
                      geometry.max_logit_bias, geometry.max_top_logprobs, 1 + drafts)


def _budget(config: EngineConfig, memory_option: str) -> str:
    if config.scheduler.num_pages:
        return "SchedulerConfig.num_pages"
    return f"EngineConfig.{memory_option}={getattr(config, memory_option)}"


def pool_page_bytes(model, page_size: int, kv_dtype) -> int:
    """Bytes one page of the pool takes: its K and V in every layer (in ``kv_dtype``), and its positions' token ids
    (the penalties')."""
    from blink.models.history import TOKEN_BYTES
    from blink.models.memory import kv_page_bytes

    return kv_page_bytes(model, page_size, kv_dtype) + TOKEN_BYTES * page_size


def pool_kv_dtype(config, model):
    """The KV pool's torch dtype for ``config.kv_cache_dtype``."""
    from blink.models.memory import kv_cache_dtype

    return kv_cache_dtype(config.kv_cache_dtype, model.dtype)


def _log_pool(num_pages: int, page_size: int, page_bytes: int) -> None:
    log.info("KV cache: %d pages x %d tokens (%.2f GiB)", num_pages, page_size, num_pages * page_bytes / 2**30)


class CpuBackend:
    """``SimScheduler`` in a background thread; its step runs the model on torch CPU over the step buffers. With
    ``followers`` (``blink.ranks``: the other tensor-parallel ranks) each step's plan goes to them first."""

    def __init__(self, model, memory, geometry: RingGeometry, config: EngineConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...], followers=None):
        import torch

        from blink.device.sim import SimScheduler
        from blink.faults import StepFaults
        from blink.models.history import TokenHistory
        from blink.ranks import Setup
        from blink.ring.layout import RingLayout

        page_size = config.scheduler.page_size
        kv_dtype = pool_kv_dtype(config, model)
        page_bytes = pool_page_bytes(model, page_size, kv_dtype)
        num_pages = config.scheduler.num_pages or int(config.cpu_kv_cache_gib * 2**30 // page_bytes)
        budget = _budget(config, "cpu_kv_cache_gib")
        self.config = scheduler_config(config, max_model_len, num_pages, eos_token_ids, budget)
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if num_pages * page_bytes > host_bytes:
            raise ValueError(f"a KV cache of {num_pages} pages takes {num_pages * page_bytes / 2**30:.1f} GiB, more "
                             f"than this host's {host_bytes / 2**30:.1f} GiB of memory: lower {budget}")
        self.model = model
        self.kv = model.allocate_kv_cache(num_pages, page_size, kv_dtype)
        _log_pool(num_pages, page_size, page_bytes)
        self.step = StepBuffers(step_layout(self.config, max_model_len, geometry))
        self.history = TokenHistory.allocate(num_pages, page_size, TokenHistory.scratch(
            self.step.layout.max_num_seqs, model.lm_head_weight().shape[0], "cpu"))
        self.followers = followers
        if followers is not None:
            followers.share(Setup(num_pages, page_size, *astuple(self.step.layout)))
        self._view = RingLayout(geometry).view(memory.buffer)
        self.ring_memory = memory
        _check_grammar_vocab(geometry, model)
        self.scheduler = SimScheduler(self._view, geometry, self.config, self.step, step_fn=self._run_step,
                                      policy=config.policy_function(), threads=config.sim_threads,
                                      history_tokens=self.history.tokens.numpy())
        # The step masks with the scheduler's mirror of the grammars region (device/grammar.py).
        self.grammars = (None if self._view.grammars is None
                         else torch.from_numpy(self.scheduler.arrays.grammar_mirror))
        # Each layer a beat: a long step that progresses is not hung. Removed at close (the model may outlive us).
        self._beats = [layer.register_forward_hook(lambda *_: self.scheduler.progress())
                       for layer in model.model.layers]
        self.faults, self._steps = StepFaults.from_env(), 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="blink-cpu-scheduler", daemon=True)
        # The largest step's matmul FLOPs at the slowest CPU expected, and a margin: a step (each of its layers beats)
        # that stands still longer is hung.
        weights = sum(p.numel() for p in model.parameters())
        self.step_limit_s = int(2 * weights * self.config.buckets[-1] / CPU_FLOPS_FLOOR) + 10

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """The scheduler loop is still running."""
        return self._thread.is_alive()

    def _run_step(self, arrays, bucket_tokens: int) -> None:
        # The CPU step needs no fixed shapes (nothing is captured), so it runs the planned tokens, not the bucket.
        n_tokens = int(arrays.query_start_loc[int(arrays.num_seqs[0])])
        self._steps += 1
        self.faults.before(self._steps)
        if self.followers is not None:
            self.followers.run(self.step, n_tokens)
        self.model(self.step, self.kv, n_tokens, self.history, self.grammars)

    def _loop(self) -> None:
        from blink.ring.control import ENGINE_STOPPED

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
        if self.followers is not None:
            self.followers.stop(clean=self.error is None)
        for beat in self._beats:
            beat.remove()
        self.scheduler = self._view = self.step = self.kv = self.history = self.model = self.followers = None
        self.grammars = None


class GpuBackend:
    """Torch-captured step graphs per bucket, device-launched by ``GpuScheduler`` from its persistent loop."""

    def __init__(self, model, memory, geometry: RingGeometry, config: EngineConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...]):
        import torch

        from blink.device.image import link_image
        from blink.device.runtime import GpuScheduler
        from blink.models.history import TokenHistory

        page_size = config.scheduler.page_size
        self.model = model
        self.step = StepBuffers(step_layout(config.scheduler, max_model_len, geometry), "cuda")
        # Allocated before the pool is sized, so that it counts as taken.
        counts = TokenHistory.scratch(self.step.layout.max_num_seqs, model.lm_head_weight().shape[0], "cuda")
        kv_dtype = pool_kv_dtype(config, model)
        page_bytes = pool_page_bytes(model, page_size, kv_dtype)
        num_pages = config.scheduler.num_pages or self._pages_that_fit(config, page_bytes, counts,
                                                                       geometry.max_grammar_bytes)
        self.config = scheduler_config(config, max_model_len, num_pages, eos_token_ids,
                                       _budget(config, "gpu_memory_utilization"))
        self.kv = model.allocate_kv_cache(num_pages, page_size, kv_dtype)
        self.history = TokenHistory.allocate(num_pages, page_size, counts)
        _log_pool(num_pages, page_size, page_bytes)
        _check_grammar_vocab(geometry, model)
        self.graphs = None
        started = time.monotonic()
        image = link_image(config.policy_function())
        log.info("compiled and linked the scheduler in %.1f s", time.monotonic() - started)
        addresses = {name: tensor.data_ptr() for name, tensor in self.step.tensors().items()}
        torch.cuda.synchronize()
        self.scheduler = GpuScheduler(memory, geometry, self.config, self.step.layout, addresses,
                                      step_graph=partial(self._step_graph, geometry.max_grammar_bytes > 0),
                                      image=image, device=torch.cuda.current_device(),
                                      request_side=config.request_side,
                                      history_tokens=(self.history.tokens.data_ptr(), self.history.tokens.numel()))
        self.ring_memory = self.scheduler.ring_memory       # the ring as this process reaches it
        self.error: BaseException | None = None
        self.step_limit_s = GPU_STEP_LIMIT_S

    def _step_graph(self, grammars: bool, tokens: int, arrays: dict) -> int:
        """The raw graph of the step for ``tokens``; the first call captures every bucket's (``GpuScheduler`` calls
        this once its state is in device memory, so that the step can read the scheduler's grammar mirror)."""
        import torch

        from blink.device.graphs import capture_steps

        if self.graphs is None:
            region = _cuda_int32(*arrays["grammar_mirror"]) if grammars else None
            started = time.monotonic()
            self.graphs = capture_steps(lambda t: self.model(self.step, self.kv, t, self.history, region),
                                        self.config.buckets)
            torch.cuda.synchronize()
            log.info("captured %d step graphs (%d..%d tokens) in %.1f s", len(self.graphs), self.config.buckets[0],
                     self.config.buckets[-1], time.monotonic() - started)
        return self.graphs[tokens].raw_cuda_graph()

    def _pages_that_fit(self, config: EngineConfig, page_bytes: int, counts, mirror_bytes: int) -> int:
        """KV pages that fit in ``gpu_memory_utilization`` of the GPU, after one step of the largest bucket and the
        scheduler's grammar mirror (``mirror_bytes``, the ring's grammars region: allocated with its state, later).

        Weights, step buffers and the penalties' scratch ``counts`` are already allocated; the largest step's
        activations are measured by running it once (on padding only, with a one-page pool), since its captured graph
        will hold that much in its pool.
        """
        import torch

        from blink.models.history import TokenHistory

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        page_size = config.scheduler.page_size
        self.model(self.step, self.model.allocate_kv_cache(1, page_size, pool_kv_dtype(config, self.model)),
                   config.scheduler.buckets[-1],
                   TokenHistory.allocate(1, page_size, counts))
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = config.gpu_memory_utilization * total - (total - free) - activations - mirror_bytes
        return max(int(budget // page_bytes), 0)

    def start(self) -> None:
        self.scheduler.start()

    def alive(self) -> bool:
        """The scheduler loop is still running (its stream has work)."""
        return self.scheduler.alive()

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
            self.scheduler = self.graphs = self.kv = self.history = self.step = self.model = None
            torch.cuda.empty_cache()


def _check_grammar_vocab(geometry: RingGeometry, model) -> None:
    """A ring's grammars must cover the tokens the model's logits have: a mask is one bit per logit."""
    logits = model.lm_head_weight().shape[0]
    if geometry.max_grammar_bytes and geometry.vocab_size != logits:
        raise ValueError(f"the ring's grammars cover {geometry.vocab_size} tokens but the model's logits have "
                         f"{logits}: build the ring with the model's vocab_size")


def _cuda_int32(address: int, shape: tuple):
    """A torch int32 tensor over ``shape`` words of device memory at ``address`` that torch did not allocate (a view:
    whoever owns the memory keeps it alive)."""
    import torch

    class Words:
        __cuda_array_interface__ = {"shape": tuple(shape), "typestr": "<i4", "data": (address, False), "version": 3}

    return torch.as_tensor(Words(), device="cuda")
