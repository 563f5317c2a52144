"""The Python API: ``Engine`` (threads) and ``AsyncEngine`` (asyncio), each an ``EngineCore`` on an in-process ring
driven by an agent in this process.

``Engine``: ``generate`` and ``stream`` submit requests and poll the ring for tokens. Polls from several threads are
serialised by one lock, and each poll's outputs are routed to the queue of the request they belong to, so any number
of streams can be consumed from any threads.

``AsyncEngine``: the agent runs in the event loop (``blink.nic.agent_loop``, as under the HTTP server): one task
polls the ring and fans tokens out to per-request queues; ``stream`` is an async iterator, and cancelling the task
that consumes it (or ``aclose``) cancels the request. Both accept stop strings (``SamplingParams.stop``).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from contextlib import suppress

import numpy as np

from blink.config import EngineConfig
from blink.core import EngineCore
from blink.errors import EngineClosed, EngineUnresponsive, RingFull
from blink.outputs import GenerationOutput, OutputBuilder, StreamDelta
from blink.ring.request import SamplingParams

POLL_INTERVAL_S = 1e-3


class _Engine:
    """What both APIs share: the core on an in-process ring, prompt encoding, and the agent on the ring."""

    def __init__(self, config: EngineConfig):
        if config.ring_name is not None:
            raise ValueError(f"EngineConfig.ring_name={config.ring_name!r}: an engine on a shared ring is driven by "
                             "an agent process of its own (blink.host.process.engine_process, blink serve); leave "
                             "ring_name out to drive the engine from Python")
        from blink.nic.agent import Agent

        self.config = config
        self.core = EngineCore(config)
        self.agent = Agent(self.core.ring_memory, self.core.geometry)
        self._grammars = None

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def device(self) -> str:
        return self.core.device

    def encode(self, prompt) -> list[int]:
        """A prompt as token ids: a string goes through the tokenizer; token ids (ints, numpy's included) must be in
        the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        tokens = [int(t) if isinstance(t, np.integer) else t for t in prompt]
        vocab = self.core.vocab_size
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}) (got {bad[:5]})")
        return tokens

    def _request(self, prompt, params: SamplingParams, priority: int = 0) -> tuple[list[int], OutputBuilder]:
        """The prompt's token ids and the request's output, after every check the ring makes: a bad request raises
        (``RequestError`` naming the field) before anything is submitted."""
        tokens = self.encode(prompt)
        self.agent.validate(tokens, params, priority)
        return tokens, OutputBuilder(tokens, params, self.tokenizer)

    def stats(self) -> dict[str, int]:
        """The scheduler's counters and gauges from the ring's control block."""
        return self.core.stats()

    def grammar(self, structured_outputs):
        """``structured_outputs`` (``blink.nic.grammars.StructuredOutputs``) compiled for this engine's model, for
        ``SamplingParams(grammar=...)``; ``GrammarError`` (a ``ValueError``) saying why it cannot be. The compiler (a
        worker process) starts at the first call and stops with the engine."""
        from blink.nic.grammars import COMPILE_TIMEOUT_S, GrammarCompiler

        g = self.agent.geometry
        if not g.max_grammar_bytes:
            raise ValueError("this engine's ring has no grammars region: set EngineConfig.max_grammar_bytes")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, g.vocab_size, g.max_grammar_bytes, COMPILE_TIMEOUT_S)
        return self._grammars.compile(structured_outputs)

    def _stop_grammars(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

    def _check_open(self) -> None:
        if self.core.closed:
            raise EngineClosed("the engine is closed: create a new Engine to submit requests")


class Engine(_Engine):
    """Serves one model to threads. ``with Engine(EngineConfig(...)) as engine: engine.generate(["Hello"])``."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        super().__init__(config)
        self._lock = threading.Lock()
        self._queues: dict[int, deque] = {}

    def close(self) -> None:
        """Abort what is in flight, stop the loop and release everything (idempotent)."""
        with self._lock:
            self._stop_grammars()
            self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 ) -> list[GenerationOutput]:
        """Run every prompt (a string, or a list of token ids) to completion; outputs in prompt order.

        ``prompts`` may also be one string or one token list. All requests are in the ring together, as far as its
        slots allow. Every request is checked before any is submitted, so a bad one raises with nothing in the ring;
        an error while they run (the engine gone, say) cancels the others.
        """
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        requests = [(*self._request(p, sp), sp) for p, sp in zip(prompts, params_list, strict=True)]
        streams = []
        try:
            for tokens, builder, sp in requests:
                streams.append(self._submit(tokens, sp, builder))
            return [s.result() for s in streams]
        except BaseException:
            for s in streams:
                with suppress(Exception):   # the error being raised says what went wrong; this is cleanup
                    s.close()
            raise

    def stream(self, prompt, params: SamplingParams = SamplingParams()) -> RequestStream:
        """Submit one request now (waiting for a free ring slot if need be); iterate the result for its tokens."""
        tokens, builder = self._request(prompt, params)
        return self._submit(tokens, params, builder)

    def _submit(self, tokens: list[int], params: SamplingParams, builder: OutputBuilder) -> RequestStream:
        while True:
            with self._lock:
                self._check_open()
                try:
                    request_id = self.agent.submit(tokens, params)
                except RingFull:
                    self._poll_locked()
                else:
                    self._queues[request_id] = deque()
                    return RequestStream(self, request_id, builder)
            time.sleep(POLL_INTERVAL_S)

    def _poll_locked(self) -> None:
        self._check_open()
        try:
            outputs = self.agent.poll()
        except EngineUnresponsive as e:
            raise e from self.core.error
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
            if not self.core.closed:
                self.agent.cancel(request_id)

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._queues.pop(request_id, None)


class RequestStream:
    """Iterator over the ``StreamDelta``s of one submitted request; ``output`` accumulates them.

    ``cancel()`` asks the scheduler to finish the request with "abort" (the stream then ends with that reason).
    ``close()`` cancels an unfinished request and stops routing its outputs here.
    """

    def __init__(self, engine: Engine, request_id: int, builder: OutputBuilder):
        self.engine, self.request_id, self._builder = engine, request_id, builder

    @property
    def output(self) -> GenerationOutput:
        return self._builder.output

    def __iter__(self):
        return self

    def __next__(self) -> StreamDelta:
        if self._builder.finished:
            raise StopIteration
        out = self.engine._next_output(self.request_id)
        delta = self._builder.push(out)
        if self._builder.stopped:
            self.close()                # a stop string: the ring's request is not needed any more
        elif out.finished:
            self.engine._forget(self.request_id)
        return delta

    def result(self) -> GenerationOutput:
        """Consume the rest of the stream; the finished output."""
        for _ in self:
            pass
        return self.output

    def cancel(self) -> None:
        self.engine._cancel(self.request_id)

    def close(self) -> None:
        if not self._builder.finished or self._builder.stopped:
            self.engine._cancel(self.request_id)
        self.engine._forget(self.request_id)


class AsyncEngine(_Engine):
    """Serves one model to asyncio code. Start it with ``await AsyncEngine.start(config)`` (loading runs in a thread)
    or construct it directly; use it inside one event loop, and ``await close()`` it there."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        super().__init__(config)
        self._loop = None
        self._task = None

    @classmethod
    async def start(cls, config: EngineConfig = EngineConfig()) -> AsyncEngine:
        """Load and start the engine without blocking the event loop."""
        return await asyncio.to_thread(cls, config)

    async def close(self) -> None:
        """Abort what is in flight, stop the loop and release everything (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._stop_grammars()
        await asyncio.to_thread(self.core.close)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def stream(self, prompt, params: SamplingParams = SamplingParams(), *, priority: int = 0) -> AsyncRequestStream:
        """Submit one request now (it waits in the agent if every ring slot is busy); ``async for`` its deltas."""
        self._check_open()
        tokens, builder = self._request(prompt, params, priority)
        return AsyncRequestStream(self._agent_loop(), self._agent_loop().submit(tokens, params, priority), builder)

    async def generate(self, prompt, params: SamplingParams = SamplingParams()) -> GenerationOutput:
        """Run one prompt to completion."""
        async with self.stream(prompt, params) as stream:
            return await stream.result()

    def _agent_loop(self):
        from blink.nic.agent_loop import AgentLoop
        from blink.nic.metrics import Metrics

        if self._loop is None:
            self._loop = AgentLoop(self.agent, Metrics())
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop.run())
        return self._loop


class AsyncRequestStream:
    """Async iterator over one request's ``StreamDelta``s; ``output`` accumulates them. ``await cancel()`` asks the
    scheduler to finish it with "abort"; ``aclose()`` (also on leaving ``async with``, or when the consuming task
    is cancelled) cancels an unfinished request and stops its outputs."""

    def __init__(self, loop, submission, builder: OutputBuilder):
        self._loop, self._submission, self._builder = loop, submission, builder

    @property
    def output(self) -> GenerationOutput:
        return self._builder.output

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self._builder.finished:
            await self.aclose()
            raise StopAsyncIteration
        try:
            out = await self._submission.queue.get()
        except BaseException:
            await self.aclose()         # cancelled while waiting: the request goes too
            raise
        if isinstance(out, Exception):
            await self.aclose()
            raise out
        delta = self._builder.push(out)
        if self._builder.finished:
            self._submission.finish_reason = delta.finish_reason
            await self.aclose()
        return delta

    async def result(self) -> GenerationOutput:
        """Consume the rest of the stream; the finished output."""
        async for _ in self:
            pass
        return self.output

    async def cancel(self) -> None:
        self._loop.cancel(self._submission)

    async def aclose(self) -> None:
        self._loop.close(self._submission)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
