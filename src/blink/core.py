"""``EngineCore``: one model served through one ring — the model, the ring, the scheduler loop on the GPU (or the
CPU), and nothing that submits requests (that is an agent's job: ``blink.engine`` in this process, ``blink agent``
in another).

Start-up checks the configuration against the model before it loads anything heavy, creates the ring (in this
process, or in shared memory for an agent process), loads the model, sizes the KV pool, builds the backend
(``blink.backends``: captured step graphs + the GPU scheduler, or the simulated scheduler + torch CPU) and starts
its loop. Every resource is registered for release as it is acquired, so a failure at any point releases what was
acquired so far and raises one error; ``close()`` releases the same way after a shutdown through the ring.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

from blink.config import EngineConfig
from blink.errors import EngineError
from blink.extras import require_engine
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout

log = logging.getLogger("blink")


class EngineCore:
    """Serves ``config.model`` through a ring it creates; ``close()`` stops the loop and releases everything.

    ``memory`` is the ring's host mapping (what an agent opens by its shared-memory name); ``ring_memory`` the ring
    as this process reaches it: ``memory`` itself, or with ``request_side="device"`` the request side's GPU copy
    joined to the output side of ``memory``. Every control word the engine writes goes through ``ring_memory``."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        self.backend = None
        self._stack = ExitStack()
        try:
            self._start(config)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, config: EngineConfig) -> None:
        require_engine("the engine")
        from blink.backends import CpuBackend, GpuBackend, select_device
        from blink.models import ModelConfig, TensorParallel, resolve_model
        from blink.ranks import load

        self.device = select_device(config.device)
        if config.request_side == "device" and self.device != "cuda":
            raise EngineError("EngineConfig.request_side='device' keeps the ring's request side in GPU memory: it "
                              "needs a GPU (device='cuda'); on the CPU use request_side='host'")
        model_dir = resolve_model(config.model)
        model_config = ModelConfig.from_file(model_dir)
        self.max_model_len = config.max_model_len(model_config.max_position_embeddings)
        self.geometry = config.geometry(self.max_model_len, model_config.vocab_size)
        self.tokenizer = _tokenizer(model_dir)
        config.policy_function()            # a bad policy path fails before the model loads
        tp = TensorParallel(config.tensor_parallel_size, 0)
        tp.shard(model_config)              # sizes that do not split fail before anything starts
        self.memory = self._stack.enter_context(create_ring(config.ring_name, self.geometry, config.request_side))
        started = time.monotonic()
        dtype = config.dtype or ("float32" if self.device == "cpu" else model_config.dtype)
        dummy = config.load_format == "dummy"
        followers = self._start_followers(config, str(model_dir), dummy, dtype)
        model = load(str(model_dir), dummy, dtype, self.device, tp, config.quantization)
        log.info("loaded %s (%s, %s%s, %s weights, %s) in %.1f s", model_dir.name, model_config.architecture, dtype,
                 " with FP8 projections" if model.config.quantization else "", config.load_format, self.device,
                 time.monotonic() - started)
        self.vocab_size = model_config.vocab_size
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        if self.device == "cpu":
            self.backend = CpuBackend(model, self.memory, self.geometry, config, self.max_model_len, eos, followers)
        else:
            self.backend = GpuBackend(model, self.memory, self.geometry, config, self.max_model_len, eos)
        self.ring_memory = self.backend.ring_memory
        control.write(self.ring_memory, "step_limit_s", self.backend.step_limit_s)
        self._stack.callback(self._stop)
        self.backend.start()
        self._wait_until_serving(self.backend.step_limit_s)
        if config.ring_name is not None:
            log.info("ring /dev/shm/%s: %.1f MiB, %d slots", config.ring_name, self.memory.size / 2**20,
                     self.geometry.n_slots)
        log.info("serving on %s (%.1f s after loading began)", self.device, time.monotonic() - started)

    def _start_followers(self, config: EngineConfig, model_dir: str, dummy: bool, dtype: str):
        """Ranks 1.. of a tensor-parallel engine (``blink.ranks``), killed if start-up fails later; None at size 1."""
        if config.tensor_parallel_size == 1:
            return None
        if self.device != "cpu":
            raise EngineError(f"EngineConfig.tensor_parallel_size={config.tensor_parallel_size} runs on the CPU "
                              "only so far (on GPUs it needs a device scheduler per GPU and NCCL inside the step "
                              "graphs, not built yet): use device='cpu' or tensor_parallel_size=1")
        from blink.ranks import Followers

        followers = Followers.start(model_dir, dummy, dtype, config.tensor_parallel_size, config.quantization,
                                    config.kv_cache_dtype)
        self._stack.callback(followers.kill)
        return followers

    def _wait_until_serving(self, timeout_s: float) -> None:
        """Return once the scheduler loop's first iteration has marked the ring served: an engine handed to its
        caller takes a request at once (an agent refuses requests while the engine is "still starting"). The first
        iteration runs no step; it gets as long as a step may take before it counts as hung."""
        deadline = time.monotonic() + timeout_s
        while (state := self.stats()["engine_state"]) != control.ENGINE_SERVING:
            if state == control.ENGINE_STOPPED or not self.backend.alive():
                raise EngineError(f"the scheduler loop ended before it served: {self.backend.error!r}")
            if time.monotonic() > deadline:
                raise EngineError(f"the scheduler loop did not begin to serve within {timeout_s:.0f} s")
            time.sleep(0.001)

    def _stop(self) -> None:
        """Shutdown through the ring (in-flight requests end with "abort"), wait for the loop, free the backend."""
        control.request_shutdown(self.ring_memory)
        backend, self.backend = self.backend, None
        backend.close()

    @property
    def closed(self) -> bool:
        return self.backend is None

    def alive(self) -> bool:
        """The scheduler loop runs."""
        return self.backend is not None and self.backend.alive()

    @property
    def error(self) -> BaseException | None:
        """What ended the loop, if it ended by itself (CPU backend: the exception the loop raised)."""
        return self.backend.error if self.backend is not None else None

    def stats(self) -> dict[str, int]:
        """The scheduler's counters and gauges from the ring's control block."""
        return control.read(self.ring_memory)

    def segments(self) -> list:
        """Where the ring's bytes are, for the listener that offers them to agents (``blink.nic.remote.attach``): the
        whole ring in its host mapping, or (``request_side="device"``) the request side's GPU allocation, exported
        with its CUDA IPC handle and dma-buf fd, and the output side's window of the host mapping. Call it on the
        thread that started the engine (the export needs its CUDA context)."""
        from blink.nic.remote.segments import HostSegment

        if self.config.request_side == "host":
            return [HostSegment(0, self.memory)]
        from blink.nic.remote.ipc import export_device_segment
        from blink.ring.split import Window

        scheduler = self.backend.scheduler
        split = scheduler.request_bytes
        return [export_device_segment(0, scheduler.request_address, split),
                HostSegment(split, Window(self.memory, split, self.memory.size - split))]

    def close(self) -> None:
        """Stop the loop and release everything (idempotent)."""
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def create_ring(name: str | None, geometry: RingGeometry, request_side: str = "host"):
    """A fresh ring: in this process (``name=None``) or in POSIX shared memory, with the key file its agents are
    given (``blink.ring.secret``: made first, removed with the ring); control block initialised. With
    ``request_side="device"`` the scheduler serves a GPU copy of its request side, so this copy is marked
    ``ENGINE_ELSEWHERE`` from its creation on: an agent that opens it by name is refused, never left waiting."""
    from blink.ring import secret
    from blink.ring.transport import LocalMemory, SharedMemory

    layout = RingLayout(geometry)
    if name is None:
        memory, digest = LocalMemory(layout.size), 0
    else:
        digest = secret.digest(secret.publish(name))
        try:
            memory = SharedMemory.create(name, layout.size)
        except BaseException:
            secret.remove(name)
            raise
        memory.also_remove(secret.key_path(name))
    memory.write(0, control.fresh(geometry, digest))
    if request_side == "device":
        control.write(memory, "engine_state", control.ENGINE_ELSEWHERE)
    return memory


def _tokenizer(model_dir: Path):
    """The model's tokenizer, or None for a directory without one (random-weight shapes: token ids only)."""
    from blink.nic.text import Tokenizer

    return Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
