"""OpenAI-compatible HTTP front of the agent: completions, chat, SSE streaming, models, health and metrics.

One asyncio event loop owns the ``Agent`` (which is not thread-safe). HTTP handlers validate the request, tokenize it
and hand it to the ``AgentLoop``; its one background task polls the ring and fans the new tokens out to per-request
queues; each handler detokenizes its tokens (``TextStream``) and writes JSON or SSE. Invariants:

- every submitted request is closed exactly once, by its handler when it leaves (``AgentLoop.close``), whether the
  ring finished it or not (stop string, client disconnect, error); closing an unfinished request cancels its slot,
  tokens the ring still delivers for it are dropped, and the agent frees the slot once the GPU side finishes it;
- a request the ring has no free slot for waits in the agent (FIFO, at most ``ServerConfig.max_queued``); beyond
  that bound, and whenever the engine is not serving, requests are refused with 429 / 503 and ``Retry-After``;
- bad input never reaches the ring: it gets a 4xx with an OpenAI-style body ``{"error": {"message", "type",
  "param", "code"}}``, and the server keeps serving everyone else.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blink.config import SamplingParams
from blink.device.ring import ENGINE_STARTING, ENGINE_STOPPED
from blink.errors import EngineUnresponsive, RingFull
from blink.nic.agent import Agent, RequestOutput
from blink.nic.text import TextStream, Tokenizer, max_tokens_for

log = logging.getLogger("blink.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # the OpenAI API's default for /v1/completions; chat defaults to the room left
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted only at their neutral values: anything else asks for a feature this server does not have.
UNSUPPORTED = {"echo": (False,), "suffix": ("",), "best_of": (1,), "logit_bias": ({},), "presence_penalty": (0,),
               "frequency_penalty": (0,), "tools": ([],), "response_format": ({"type": "text"},)}


@dataclass(frozen=True)
class ServerConfig:
    """``max_queued``: requests that may wait in the agent for a free ring slot; more get 429.
    ``heartbeat_timeout_s``: how long the engine's heartbeat may stand still before /health fails and new requests
    get 503. ``poll_interval_s``: pause between polls while requests are in flight and the last poll found nothing.
    """

    model_name: str
    max_queued: int = 1024
    heartbeat_timeout_s: float = 5.0
    poll_interval_s: float = 200e-6
    retry_after_s: int = 1


_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; ``message`` says what was wrong and what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


@web.middleware
async def _errors(request, handler):
    """Every error leaves as an OpenAI-style JSON body, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, f"{e.reason}: {request.method} {request.path}").response()
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return ApiError(500, "internal server error (see the server log)").response()


# -- request parsing -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """A validated request, ready for the ring."""

    chat: bool
    prompt: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    priority: int


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()      # aiohttp answers 413 beyond the app's client_max_size
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start}): "
                            "send UTF-8 encoded JSON") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field(body: dict, name: str, kinds: tuple, rule: str, default=None, ok=lambda v: True):
    """``body[name]`` checked to be one of ``kinds`` (bool only if listed) and ``ok``; ``default`` if absent/null."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds) or not ok(value):
        raise ApiError(400, f"'{name}' must be {rule} (got {_show(value)})", param=name)
    return value


def _text(value: str, param: str) -> str:
    """Tokenizers need valid Unicode: JSON can smuggle in unpaired surrogates (\\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' contains an unpaired UTF-16 surrogate: send valid Unicode text",
                       param=param) from None
    return value


class _Parser:
    """Turns request bodies into ``Job``s against one model and one ring's limits."""

    def __init__(self, tokenizer: Tokenizer, config: ServerConfig, agent: Agent):
        g = agent.geometry
        self.tokenizer, self.model_name, self.geometry = tokenizer, config.model_name, g
        self.context_len = tokenizer.context_len or g.max_prompt_tokens + g.max_output_tokens
        self.max_prompt = min(g.max_prompt_tokens, self.context_len - 1)

    def completion(self, body: dict) -> Job:
        prompt = self._completion_prompt(body.get("prompt"))
        logprobs = _field(body, "logprobs", (int,), "0 (only the sampled token's logprob is available) or null",
                          None, lambda v: v == 0)
        return self._job(body, prompt, chat=False, logprobs=logprobs is not None,
                         max_tokens=body.get("max_tokens"), default_max=COMPLETIONS_DEFAULT_MAX_TOKENS)

    def chat(self, body: dict) -> Job:
        messages = self._messages(body.get("messages"))
        try:
            prompt = self.tokenizer.encode_chat(messages)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        _field(body, "top_logprobs", (int,), "0 or null (only the sampled token's logprob is available)", 0,
               lambda v: v == 0)
        logprobs = _field(body, "logprobs", (bool,), "a boolean", False)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        return self._job(body, prompt, chat=True, logprobs=logprobs, max_tokens=max_tokens, default_max=None)

    def _job(self, body: dict, prompt: list[int], *, chat: bool, logprobs: bool, max_tokens, default_max) -> Job:
        self._check_model(body)
        for name, neutral in UNSUPPORTED.items():
            if body.get(name) not in (None, *neutral):
                raise ApiError(400, f"'{name}' is not supported by this server (got {_show(body[name])}): "
                                    "leave it out", param=name)
        _field(body, "n", (int,), "1: this server returns one choice per request, send n requests instead", 1,
               lambda v: v == 1)
        if len(prompt) > self.max_prompt:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens but this server accepts at most "
                                f"{self.max_prompt}: shorten it", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if logprobs and not self.geometry.logprobs:
            raise ApiError(400, "logprobs are not available: the ring was built without a logprobs area",
                           param="logprobs")
        stream = _field(body, "stream", (bool,), "a boolean", False)
        options = _field(body, "stream_options", (dict,), "an object like {\"include_usage\": true}", {})
        include_usage = _field(options, "include_usage", (bool,), "a boolean", False)
        priority = _field(body, "priority", (int,), "an integer in [-2**31, 2**31)", 0,
                          lambda v: -2**31 <= v < 2**31)
        params = self._sampling(body, len(prompt), max_tokens, default_max, logprobs)
        return Job(chat, prompt, params, self._stop(body), stream, include_usage, priority)

    def _sampling(self, body, prompt_len: int, max_tokens, default_max: int | None, logprobs: bool) -> SamplingParams:
        requested = _field({"max_tokens": max_tokens}, "max_tokens", (int,), "an integer >= 1", None,
                           lambda v: v >= 1)
        try:
            room = max_tokens_for(requested, prompt_len, self.context_len, self.geometry.max_output_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        if requested is None and default_max is not None:
            room = min(room, default_max)
        vocab = self.tokenizer.vocab_size
        stop_ids = _field(body, "stop_token_ids", (list,),
                          f"a list of at most {self.geometry.max_stop_ids} token ids in [0, {vocab})", [],
                          lambda v: len(v) <= self.geometry.max_stop_ids and all(_is_token(t, vocab) for t in v))
        seed = _field(body, "seed", (int,), "an integer in [-2**63, 2**64)", None, lambda v: -2**63 <= v < 2**64)
        top_k = _field(body, "top_k", (int,), "an integer >= -1 (-1 or 0: no top-k)", 0, lambda v: v >= -1)
        return SamplingParams(
            max_tokens=room,
            temperature=_field(body, "temperature", (int, float), "a number >= 0 (0: greedy)", 1.0,
                               lambda v: 0 <= v and math.isfinite(v)),
            top_p=_field(body, "top_p", (int, float), "a number in (0, 1]", 1.0, lambda v: 0 < v <= 1),
            top_k=max(top_k, 0),
            seed=None if seed is None else seed % 2**64,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_field(body, "ignore_eos", (bool,), "a boolean", False),
            logprobs=logprobs)

    def _check_model(self, body: dict) -> None:
        model = _field(body, "model", (str,), "a string", self.model_name)
        if model != self.model_name:
            raise ApiError(404, f"the model {_show(model)} does not exist: this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def _stop(self, body: dict) -> tuple[str, ...]:
        rule = f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings"
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        _field({"stop": stop}, "stop", (list,), rule, None,
               lambda v: len(v) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in v))
        return tuple(_text(s, "stop") for s in stop or ())

    def _completion_prompt(self, prompt) -> list[int]:
        """A string or a list of token ids, alone or as a one-element batch."""
        rule = ("a string, a list of token ids, or a one-element list of either (batches of prompts: send one "
                "request per prompt)")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(_text(prompt, "prompt"))
        elif isinstance(prompt, list) and all(_is_token(t, self.tokenizer.vocab_size) for t in prompt):
            ids = prompt
        else:
            raise ApiError(400, f"'prompt' must be {rule}, with token ids in [0, {self.tokenizer.vocab_size}) "
                                f"(got {_show(prompt)})", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty: send at least one token", param="prompt")
        return ids

    def _messages(self, messages) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, f"'messages' must be a non-empty list of messages (got {_show(messages)})",
                           param="messages")
        return [self._message(m, i) for i, m in enumerate(messages)]

    def _message(self, message, i: int) -> dict:
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ApiError(400, f"'{param}' must be an object with a 'role' in {list(CHAT_ROLES)} "
                                f"(got {_show(message)})", param=param)
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'{param}.content' must be a string or a list of text parts "
                                f"({{\"type\": \"text\", \"text\": ...}}); only text is supported "
                                f"(got {_show(content)})", param=f"{param}.content")
        return {"role": message["role"], "content": _text(content, f"{param}.content")}


def _is_token(value, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


# -- the agent loop --------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Request:
    """One request's life in the agent: waiting for a slot, then in the ring, then closed."""

    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # RequestOutputs, or an exception that ends it
    request_id: int | None = None       # set once the ring has it
    last_token_at: float | None = None
    finish_reason: str | None = None    # what the client was told, once it was
    closed: bool = False


class AgentLoop:
    """Owns the Agent inside the event loop: submissions, the wait queue for a full ring, and the polling task."""

    HEARTBEAT_SAMPLE_S = 0.1

    def __init__(self, agent: Agent, metrics: Metrics, config: ServerConfig):
        self.agent, self.metrics, self.config = agent, metrics, config
        self.waiting: deque[_Request] = deque()       # the ring was full: FIFO, at most config.max_queued
        self._active: dict[int, _Request] = {}        # request id -> request whose outputs someone awaits
        self._wakeup = asyncio.Event()
        self._stats = agent.stats()
        self._beat_at = self._sampled_at = time.monotonic()
        self._crashed: str | None = None

    def submit(self, prompt: list[int], params: SamplingParams, priority: int) -> _Request:
        problem = self.health()
        if problem:
            raise ApiError(503, f"{problem}: retry later", retry_after_s=self.config.retry_after_s)
        req = _Request(prompt, params, priority)
        if self.waiting or not self._to_ring(req):
            if len(self.waiting) >= self.config.max_queued:
                raise ApiError(429, f"the server is at capacity ({self.agent.in_flight} requests in the ring, "
                                    f"{len(self.waiting)} queued): retry later",
                               retry_after_s=self.config.retry_after_s)
            self.waiting.append(req)
        self.metrics.prompt_tokens.inc(len(prompt))
        self._wakeup.set()
        return req

    def close(self, req: _Request) -> None:
        """The handler is done with ``req``; if the ring has not finished it, cancel it. Idempotent."""
        if req.closed:
            return
        req.closed = True
        if req.request_id is None:
            self.waiting.remove(req)
        elif self._active.pop(req.request_id, None) is not None:
            self.agent.cancel(req.request_id)
        self.metrics.finished(req, req.finish_reason or "abort")

    def health(self) -> str | None:
        """Why the engine cannot serve now, or None when it can."""
        if self._crashed:
            return self._crashed
        stats = self._sample_heartbeat()
        if stats["launch_error"]:
            return f"the GPU loop reported device graph launch error {stats['launch_error']}"
        if stats["engine_state"] == ENGINE_STOPPED:
            return "the engine has stopped"
        if stats["engine_state"] == ENGINE_STARTING:
            return "the engine is still starting"
        still = time.monotonic() - self._beat_at
        if still > self.config.heartbeat_timeout_s:
            return f"the engine's heartbeat has not moved for {still:.1f} s"
        return None

    async def run(self) -> None:
        try:
            while True:
                await self._iterate()
        except Exception as e:
            log.exception("the agent loop crashed")
            self._crashed = f"the agent loop crashed ({e!r})"
            self._fail_all(self._crashed)
            raise

    async def _iterate(self) -> None:
        if not self.agent.in_flight and not self.waiting:
            # Idle: sleep until a submission, waking now and then to keep the heartbeat sample fresh.
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self.HEARTBEAT_SAMPLE_S)
            self._wakeup.clear()
        if time.monotonic() - self._sampled_at > self.HEARTBEAT_SAMPLE_S:
            self._sample_heartbeat()
        try:
            outputs = self.agent.poll()
        except EngineUnresponsive as e:
            self._fail_all(str(e))
            await asyncio.sleep(self.HEARTBEAT_SAMPLE_S)
            return
        for out in outputs:
            self._deliver(out)
        while self.waiting and self._to_ring(self.waiting[0]):
            self.waiting.popleft()
        await asyncio.sleep(0 if outputs else self.config.poll_interval_s)

    def _to_ring(self, req: _Request) -> bool:
        """Submit ``req`` to the ring; False if no slot is free."""
        try:
            req.request_id = self.agent.submit(req.prompt, req.params, priority=req.priority)
        except RingFull:
            return False
        self._active[req.request_id] = req
        return True

    def _deliver(self, out: RequestOutput) -> None:
        req = self._active.get(out.request_id)
        if req is None:
            return      # closed by its handler; the agent frees the slot once the GPU side has finished it
        self.metrics.tokens(req, len(out.new_tokens))
        req.queue.put_nowait(out)
        if out.finished:
            del self._active[out.request_id]

    def _fail_all(self, problem: str) -> None:
        """End every open request with ``problem``; their handlers answer 503 and close them."""
        error = ApiError(503, f"{problem}: retry later", retry_after_s=self.config.retry_after_s)
        for req in [*self._active.values(), *self.waiting]:
            req.queue.put_nowait(error)

    def _sample_heartbeat(self) -> dict:
        now = time.monotonic()
        stats = self.agent.stats()
        if stats["heartbeat"] != self._stats["heartbeat"]:
            self._beat_at = now
        self._stats, self._sampled_at = stats, now
        return stats


# -- metrics -------------------------------------------------------------------------------------------------------

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Prometheus metrics: the agent's own timings and counters, plus the ring's control block read at scrape time."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("blink_time_to_first_token_seconds", "From submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("blink_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("blink_e2e_request_latency_seconds", "From submission to the end of the request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("blink_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.requests = Counter("blink_requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)

    def watch(self, loop: AgentLoop) -> None:
        self.registry.register(_RingCollector(loop))

    def tokens(self, req: _Request, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if req.last_token_at is None:
            self.ttft.observe(now - req.arrival)
        else:
            # Tokens that arrive in one poll share the gap since the previous poll's tokens.
            for _ in range(n):
                self.itl.observe((now - req.last_token_at) / n)
        req.last_token_at = now

    def finished(self, req: _Request, reason: str) -> None:
        self.e2e.observe(time.monotonic() - req.arrival)
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RingCollector:
    """Gauges and counters the GPU side keeps in the ring's control block, plus the agent's wait queue."""

    def __init__(self, loop: AgentLoop):
        self.loop = loop

    def collect(self):
        s = self.loop.agent.stats()
        gauges = {"blink_requests_running": ("Requests the engine is running", s["running"]),
                  "blink_requests_waiting": ("Requests in the ring not yet admitted", s["waiting"]),
                  "blink_requests_queued": ("Requests waiting in the agent for a free ring slot",
                                            len(self.loop.waiting)),
                  "blink_kv_cache_usage_ratio": ("Fraction of KV-cache pages in use",
                                                 1 - s["kv_pages_free"] / s["kv_pages_total"]
                                                 if s["kv_pages_total"] else 0.0)}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {"blink_generation_tokens": ("Tokens generated by the engine", s["tokens"]),
                    "blink_preemptions": ("Recompute preemptions", s["preempted"]),
                    "blink_engine_steps": ("Model steps launched", s["steps"])}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


# -- HTTP ------------------------------------------------------------------------------------------------------------

class OpenAIServer:
    """The aiohttp application (``.app``) serving one model through one ``Agent``."""

    def __init__(self, agent: Agent, tokenizer: Tokenizer, config: ServerConfig):
        self.tokenizer, self.config = tokenizer, config
        self.parser = _Parser(tokenizer, config, agent)
        self.metrics = Metrics()
        self.loop = AgentLoop(agent, self.metrics, config)
        self.metrics.watch(self.loop)
        self.created = int(time.time())
        self.app = web.Application(middlewares=[_errors])
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.get("/metrics", self.metrics_text)])
        self.app.cleanup_ctx.append(self._poller)

    async def _poller(self, app):
        task = asyncio.create_task(self.loop.run())
        yield
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.parser.completion(await _json_body(request)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.parser.chat(await _json_body(request)))

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "blink",
                 "max_model_len": self.parser.context_len}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        problem = self.loop.health()
        if problem:
            raise ApiError(503, problem, retry_after_s=self.config.retry_after_s)
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # -- one request -----------------------------------------------------------------------------------------------

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        req = self.loop.submit(job.prompt, job.params, job.priority)
        text = TextStream(self.tokenizer, job.stop)
        try:
            if job.stream:
                return await self._stream(request, job, req, text)
            return await self._complete(job, req, text)
        finally:
            # Runs on disconnect too: aiohttp cancels the handler (handler_cancellation=True).
            self.loop.close(req)

    async def _events(self, req: _Request, text: TextStream):
        """Yield ``(delta, [(token, logprob)], finish_reason)`` per batch of tokens; the last has a finish_reason."""
        while True:
            out = await req.queue.get()
            if isinstance(out, ApiError):
                raise out
            delta, tokens = "", []
            for i, token in enumerate(out.new_tokens):
                delta += text.push(token)
                tokens.append((token, out.new_logprobs[i] if out.new_logprobs else None))
                if text.stopped:
                    break
            if text.stopped or out.finished:
                req.finish_reason = "stop" if text.stopped else out.finish_reason
                yield delta + text.finish(), tokens, req.finish_reason
                return
            yield delta, tokens, None

    async def _complete(self, job: Job, req: _Request, text: TextStream) -> web.Response:
        content, tokens = "", []
        async for delta, new_tokens, _ in self._events(req, text):
            content += delta
            tokens += new_tokens
        choice = self._choice(job, content, tokens, req.finish_reason, chunk=False)
        return web.json_response({**self._head(job, chunk=False), "choices": [choice],
                                  "usage": self._usage(job, text)})

    async def _stream(self, request: web.Request, job: Job, req: _Request, text: TextStream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = self._head(job, chunk=True)
        try:
            if job.chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                await _send(response, {**head, "choices": [first]})
            async for delta, tokens, finish in self._events(req, text):
                if delta or finish:
                    await _send(response, {**head, "choices": [self._choice(job, delta, tokens, finish, chunk=True)]})
            if job.include_usage:
                await _send(response, {**head, "choices": [], "usage": self._usage(job, text)})
        except ApiError as e:
            await _send(response, e.body())
        except ConnectionResetError:
            return response     # the client left; _serve's finally cancels the request
        await response.write(b"data: [DONE]\n\n")
        return response

    def _head(self, job: Job, *, chunk: bool) -> dict:
        if job.chat:
            kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.config.model_name}

    def _choice(self, job: Job, text: str, tokens: list, finish: str | None, *, chunk: bool) -> dict:
        if not job.chat:
            body = {"text": text}
        elif chunk:
            body = {"delta": {"content": text} if text else {}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": self._logprobs(job, tokens), "finish_reason": finish}

    def _logprobs(self, job: Job, tokens: list) -> dict | None:
        """The sampled tokens' logprobs (no alternatives: the ring carries only the sampled token's)."""
        if not job.params.logprobs:
            return None
        strings = [self.tokenizer.decode([t], skip_special_tokens=False) for t, _ in tokens]
        if job.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": None, "top_logprobs": []}
                                for s, (_, lp) in zip(strings, tokens, strict=True)]}
        return {"tokens": strings, "token_logprobs": [lp for _, lp in tokens]}

    def _usage(self, job: Job, text: TextStream) -> dict:
        n_prompt, n_completion = len(job.prompt), text.n_tokens
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


async def start(server: OpenAIServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``server`` on ``host:port`` (0: any free port) in the running loop; returns the runner and the port."""
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


def run(server: OpenAIServer, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM (Ctrl-C)."""
    web.run_app(server.app, host=host, port=port, handler_cancellation=True, access_log=None)
