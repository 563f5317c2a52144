"""The engine: model + ring + scheduler loop on the GPU (or the CPU), and a Python API that drives the ring.

Start-up (``Engine(config)``) checks the configuration against the model before it loads anything heavy, creates
the ring (in this process, or in shared memory for an agent process), loads the model, sizes the KV pool, builds the
backend (``blink.backends``: captured step graphs + the GPU scheduler, or the simulated scheduler + torch CPU) and
starts its loop. Every resource is registered for release as it is acquired, so a failure at any point releases
what was acquired so far and raises one error; ``close()`` releases the same way after a shutdown through the ring.

With an in-process ring an ``Agent`` in this process drives it: ``generate`` and ``stream`` submit requests and
poll the ring for tokens. Polls from several threads are serialised by one lock, and each poll's outputs are routed
to the queue of the request they belong to, so any number of streams can be consumed from any threads.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from blink.config import EngineConfig, SamplingParams
from blink.device.ring import CONTROL_DTYPE, RingGeometry, RingLayout
from blink.errors import EngineUnresponsive, RingFull

POLL_INTERVAL_S = 1e-3


def progress(message: str) -> None:
    print(f"blink: {message}", file=sys.stderr, flush=True)


@dataclass
class GenerationOutput:
    """One finished request. ``text`` is None when the model directory has no tokenizer."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None     # "stop", "length", "abort" or "error"
    logprobs: list[float] | None = None


@dataclass(frozen=True)
class StreamDelta:
    """What one request produced since the previous delta; the last one carries the finish reason."""

    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str | None


class RequestStream:
    """Iterator over the ``StreamDelta``s of one submitted request; ``output`` accumulates them.

    ``cancel()`` asks the scheduler to finish the request with "abort" (the stream then ends with that reason).
    ``close()`` cancels an unfinished request and stops routing its outputs here.
    """

    def __init__(self, engine: Engine, request_id: int, prompt: list[int], params: SamplingParams):
        self.engine, self.request_id = engine, request_id
        self.output = GenerationOutput(list(prompt), logprobs=[] if params.logprobs else None)
        self._detokenizer = engine.detokenizer()
        if self._detokenizer is not None:
            self.output.text = ""

    def __iter__(self):
        return self

    def __next__(self) -> StreamDelta:
        if self.output.finish_reason is not None:
            raise StopIteration
        out = self.engine._next_output(self.request_id)
        text = None
        if self._detokenizer is not None:
            text = "".join(self._detokenizer.push(t) for t in out.new_tokens)
            text += self._detokenizer.flush() if out.finished else ""
            self.output.text += text
        self.output.token_ids += out.new_tokens
        if out.new_logprobs is not None:
            self.output.logprobs += out.new_logprobs
        self.output.finish_reason = out.finish_reason
        if out.finished:
            self.engine._forget(self.request_id)
        return StreamDelta(out.new_tokens, text, out.new_logprobs, out.finish_reason)

    def result(self) -> GenerationOutput:
        """Consume the rest of the stream; the finished output."""
        for _ in self:
            pass
        return self.output

    def cancel(self) -> None:
        self.engine._cancel(self.request_id)

    def close(self) -> None:
        if self.output.finish_reason is None:
            self.engine._cancel(self.request_id)
        self.engine._forget(self.request_id)


class Engine:
    """Serves one model. ``with Engine(EngineConfig(...)) as engine: engine.generate(["Hello"])``."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        self._stack = ExitStack()
        self._lock = threading.Lock()
        self._queues: dict[int, deque] = {}
        try:
            self._start(config)
        except BaseException:
            self._stack.close()
            raise

    # -- start-up ---------------------------------------------------------------------------------------------------

    def _start(self, config: EngineConfig) -> None:
        from blink.backends import CpuBackend, GpuBackend, select_device
        from blink.models import ModelConfig, default_model_path, load_model, random_model

        self.device = select_device(config.device)
        model_dir = Path(config.model) if config.model is not None else default_model_path()
        model_config = ModelConfig.from_file(model_dir)
        self.max_model_len = resolve_max_model_len(config, model_config)
        self.tokenizer = _tokenizer(model_dir)
        self.geometry = config.geometry()
        self.memory = self._stack.enter_context(create_ring(config.ring_name, self.geometry))
        started = time.monotonic()
        dtype = config.dtype or ("float32" if self.device == "cpu" else model_config.dtype)
        if config.load_format == "dummy":
            model = random_model(model_config, device=self.device, dtype=dtype)
        else:
            model = load_model(model_dir, device=self.device, dtype=dtype)
        progress(f"loaded {model_dir.name} ({model_config.architecture}, {dtype}, {config.load_format} weights, "
                 f"{self.device}) in {time.monotonic() - started:.1f} s")
        self.vocab_size = model_config.vocab_size
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        backend_class = CpuBackend if self.device == "cpu" else GpuBackend
        self.backend = backend_class(model, self.memory, self.geometry, config, self.max_model_len, eos, progress)
        self._stack.callback(self._stop)
        self.backend.start()
        if config.ring_name is None:
            from blink.nic.agent import Agent

            self.agent = Agent(self.memory, self.geometry)
        else:
            self.agent = None
            progress(f"ring /dev/shm/{config.ring_name}: {self.memory.size / 2**20:.1f} MiB, "
                     f"{self.geometry.n_slots} slots")
        progress(f"serving on {self.device} ({time.monotonic() - started:.1f} s after loading began)")

    def _stop(self) -> None:
        """Shutdown through the ring (in-flight requests end with "abort"), wait for the loop, free the backend."""
        self.memory.write(CONTROL_DTYPE.fields["shutdown"][1], (1).to_bytes(4, "little"))
        backend, self.backend = self.backend, None
        backend.close()

    def close(self) -> None:
        """Stop the loop and release everything (idempotent)."""
        with self._lock:
            self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the Python API ---------------------------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 ) -> list[GenerationOutput]:
        """Run every prompt (a string, or a list of token ids) to completion; outputs in prompt order.

        ``prompts`` may also be one string or one token list. All requests are in the ring together, as far as its
        slots allow.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        streams = [self.stream(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        return [s.result() for s in streams]

    def stream(self, prompt, params: SamplingParams = SamplingParams()) -> RequestStream:
        """Submit one request now (waiting for a free ring slot if need be); iterate the result for its tokens."""
        tokens = self.encode(prompt)
        while True:
            with self._lock:
                agent = self._agent()
                try:
                    request_id = agent.submit(tokens, params)
                except RingFull:
                    self._poll_locked()
                else:
                    self._queues[request_id] = deque()
                    return RequestStream(self, request_id, tokens, params)
            time.sleep(POLL_INTERVAL_S)

    def encode(self, prompt) -> list[int]:
        """A prompt as token ids: a string goes through the tokenizer; token ids must be in the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        tokens = list(prompt)
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size}) (got {bad[:5]})")
        return tokens

    def detokenizer(self):
        from blink.nic.text import Detokenizer

        return Detokenizer(self.tokenizer) if self.tokenizer is not None else None

    def stats(self) -> dict[str, int]:
        """The scheduler's counters and gauges from the ring's control block."""
        control = RingLayout(self.geometry).view(self.memory.buffer).control[0]
        return {name: int(control[name]) for name in CONTROL_DTYPE.names}

    # -- routing outputs to requests --------------------------------------------------------------------------------

    def _agent(self):
        if self.backend is None:
            raise RuntimeError("the engine is closed")
        if self.agent is None:
            raise RuntimeError(f"this engine serves the shared ring {self.config.ring_name!r}: submit through the "
                               "agent process that drives it (blink agent), not through Engine.generate")
        return self.agent

    def _poll_locked(self) -> None:
        try:
            outputs = self._agent().poll()
        except EngineUnresponsive as e:
            raise e from self.backend.error
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.append(out)

    def _next_output(self, request_id: int):
        """The next ``RequestOutput`` of one request, polling the ring until there is one."""
        while True:
            with self._lock:
                queue = self._queues[request_id]
                if not queue:
                    self._poll_locked()
                if queue:
                    return queue.popleft()
            time.sleep(POLL_INTERVAL_S)

    def _cancel(self, request_id: int) -> None:
        with self._lock:
            self._agent().cancel(request_id)

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._queues.pop(request_id, None)


def serve_ring(config: EngineConfig) -> None:
    """Process entry point (``blink engine``): serve the shared ring ``config.ring_name`` until SIGINT or SIGTERM,
    or until a shutdown is requested through the ring; then stop cleanly (the ring is removed)."""
    import signal

    # The signal only sets an event: an exception raised asynchronously inside threading's own waits (is_alive,
    # join) can leave a thread's state lock held, and the shutdown's join would then hang forever.
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with Engine(config) as engine:
        # Once a second: waiting is all the host does while the loop serves.
        while engine.backend.alive() and not stop.wait(1.0):
            pass
    progress("stopped")


def resolve_max_model_len(config: EngineConfig, model_config) -> int:
    """``EngineConfig.max_model_len`` or its default; ``ValueError`` if the model or the ring cannot use it."""
    context = model_config.max_position_embeddings
    length = config.max_model_len or min(context, config.max_prompt_tokens + config.max_output_tokens)
    if length > context:
        raise ValueError(f"EngineConfig.max_model_len={length} is longer than the model's context "
                         f"(max_position_embeddings={context}): lower it")
    if config.max_prompt_tokens >= length:
        raise ValueError(f"EngineConfig.max_prompt_tokens={config.max_prompt_tokens} leaves no room to generate in "
                         f"sequences of max_model_len={length} tokens (the model's context is {context}): lower "
                         "max_prompt_tokens")
    return length


def create_ring(name: str | None, geometry: RingGeometry):
    """A fresh ring: in this process (``name=None``) or in POSIX shared memory; control block initialised."""
    from blink.nic.transport import LocalMemory, SharedMemory

    layout = RingLayout(geometry)
    memory = LocalMemory(layout.size) if name is None else SharedMemory.create(name, layout.size)
    memory.write(0, layout.control_bytes())
    return memory


def _tokenizer(model_dir: Path):
    """The model's tokenizer, or None for a directory without one (random-weight shapes: token ids only)."""
    from blink.nic.text import Tokenizer

    return Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
