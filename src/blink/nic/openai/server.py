"""OpenAI-compatible HTTP front of the agent: the aiohttp app (``OpenAIServer``) with its routes for completions,
chat, models, health (``/health``; ``/livez`` and ``/readyz`` from ``health``), metrics, and vLLM's ``/version``,
``/tokenize`` and ``/detokenize`` (``tokenization``); its ``ServerConfig``; and the entry points ``start`` and ``run``
(SIGTERM drains: ``blink.nic.drain``).

One asyncio event loop owns the ``Agent`` (which is not thread-safe). A handler reads the body within the limits
(``limits``; what a connection may hold before that: ``connections``), parses it (``requests``) on the loop when its
prompt is token ids and in a tokenizer thread when it must be tokenized (tokenizing a long prompt must not stall the
loop; a thread's round trip is two more wake-ups per request, which cost the most where the agent shares its core),
hands it to the ``AgentLoop`` (``blink.nic.agent_loop``), whose one task polls the ring and writes each stream's
new tokens (``responses``). Every request a handler submits it closes when it leaves, whatever the reason; every
error, aiohttp's own included, leaves as an OpenAI-style body, and the server keeps serving everyone else.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from blink.errors import RequestError
from blink.nic.agent import Agent
from blink.nic.agent_loop import AgentLoop, LoopConfig
from blink.nic.metrics import Metrics
from blink.nic.defaults import SamplingDefaults
from blink.nic.drain import ABORT_GRACE_S, Drain, DrainConfig
from blink.nic.grammars import COMPILE_TIMEOUT_S, GrammarCompiler
from blink.nic.openai.errors import REFUSALS, ApiError, api_error
from blink.nic.openai.health import LoadGauges, Probes
from blink.nic.openai.connections import ConnectionGuard, JsonErrors
from blink.nic.openai.ports import cannot_listen
from blink.nic.openai.limits import BodyPlaces, HttpLimits, OneLineBadRequests, is_small, read_body
from blink.nic.openai import structured
from blink.nic.openai.requests import Job, Parser, json_body
from blink.nic.openai.responses import Responder
from blink.nic.openai.tokenization import Tokenization, vllm_json
from blink.nic.text import Tokenizer
from blink.version import __version__

log = logging.getLogger("blink.server")
logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
LINGER_S = 1.0
BEARER = "bearer "            # RFC 7235: an authentication scheme's name is case-insensitive


@dataclass(frozen=True)
class ServerConfig:
    """``model_name``: the name clients use; ``loop``: the agent loop's bounds and timing (``LoopConfig``: the wait
    queue beyond which requests get 429); ``limits``: what a client may hold of the server (``HttpLimits``);
    ``api_key``: when set, every /v1 request must carry ``Authorization: Bearer <api_key>`` (else 401; /health and
    /metrics stay open, as in vLLM; ``api_key.api_key_from`` reads it as ``blink serve`` takes it); ``defaults``:
    the sampling of fields a request leaves out.
    ``drain``: how long a SIGTERM waits for the requests in flight (``blink.nic.drain``).
    ``thread_start``: called first in each thread the server starts (its tokenizer threads), e.g. to give them a
    priority the loop's thread does not pass on (``blink serve``: ``blink.host.priority.helper_priority``).
    ``grammar_timeout_s``: the longest one structured output may take to compile (``blink.nic.grammars``).
    ``tool_call_parser``: the format the model writes tool calls in (``tool_parsers``; None: its chat template's).
    /health fails and requests get 503 while the agent's ``Liveness`` says the engine is not serving."""

    model_name: str
    loop: LoopConfig = LoopConfig()
    limits: HttpLimits = field(default_factory=HttpLimits)
    api_key: str | None = None
    defaults: SamplingDefaults = SamplingDefaults()
    drain: DrainConfig = DrainConfig()
    thread_start: Callable[[], None] | None = None
    grammar_timeout_s: float = COMPILE_TIMEOUT_S
    tool_call_parser: str | None = None


class OpenAIServer:
    """The aiohttp application (``.app``) serving one model through one ``Agent``."""

    ENGINE_WATCH_S = 0.5

    def __init__(self, agent: Agent, tokenizer: Tokenizer, config: ServerConfig, engine_gone=None):
        """``engine_gone()``, if given, says why the engine is gone for good (its process exited), or None; the
        server then fails what is in flight and stops with ``exit_code`` 1, for a supervisor to restart it."""
        self.tokenizer, self.config, self.engine_gone = tokenizer, config, engine_gone
        self.exit_code = 0
        self.stopped = asyncio.Event()
        g = agent.geometry
        self.grammars = (GrammarCompiler(tokenizer, g.vocab_size, g.max_grammar_bytes, config.grammar_timeout_s)
                         if g.max_grammar_bytes else None)
        self.parser = Parser(tokenizer, config.model_name, agent, config.defaults, self.grammars,
                             config.tool_call_parser)
        self.tokenization = Tokenization(self.parser)
        self.metrics = Metrics()
        self.loop = AgentLoop(agent, self.metrics, config.loop)
        self.responder = Responder(tokenizer, config.model_name, self.metrics, self.loop.close)
        self.metrics.watch(self.loop, config.model_name)
        self.drain = Drain(self.loop, config.drain)
        self.probes = Probes(self.loop, self.drain)
        LoadGauges(self.probes, self.metrics)
        self.guard, self.places = ConnectionGuard(config.limits), BodyPlaces(config.limits)
        # Two tokenizer threads, one for small bodies and one for large ones (``limits.is_small``): a small chat
        # never waits behind the tokenizing of large prompts (16 of them made small chats wait 21 s in one queue).
        self._tokenizing = {small: ThreadPoolExecutor(1, thread_name_prefix=f"blink-tokenizer-{name}",
                                                      initializer=config.thread_start)
                            for small, name in ((True, "small"), (False, "large"))}
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._errors, self._admit],
                                   client_max_size=config.limits.max_body_bytes)
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.get("/v1/models", self.models), web.get("/v1/models/{model:.+}", self.model),
                             web.get("/health", self.health), web.get("/metrics", self.metrics_text),
                             web.get("/version", self.version), web.post("/tokenize", self.tokenize),
                             web.post("/detokenize", self.detokenize)])
        self.app.add_routes(self.probes.routes())         # /livez, /readyz (blink.nic.openai.health)
        self.app.cleanup_ctx.append(self._background)

    @web.middleware
    async def _errors(self, request, handler):
        """Every error leaves as an OpenAI-style JSON body, aiohttp's own (404, 405, 413) included. An answer to a
        request whose body was not read whole (refused before it was) closes its connection: the guard counts the
        next request head from the first byte after the response (``connections``), which must not be that body's."""
        response = await self._respond(request, handler)
        if request.content.is_eof():
            self.guard.response_done(request.transport)
        else:
            response.force_close()
        return response

    async def _respond(self, request, handler) -> web.StreamResponse:
        try:
            self._check_api_key(request)
            return await handler(request)
        except REFUSALS as e:
            return api_error(e).response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = ApiError(e.status, f"{e.reason}: {request.method} {request.path}").response()
            if "Allow" in e.headers:        # a 405 says which methods the path takes
                response.headers["Allow"] = e.headers["Allow"]
            return response
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return ApiError(500, "internal server error (see the server log)").response()

    def _check_api_key(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None or not request.path.startswith("/v1"):
            return
        given = request.headers.get("Authorization", "")
        scheme, credentials = given[:len(BEARER)], given[len(BEARER):]
        # aiohttp decodes header bytes with surrogateescape: encode them back the same way (a non-UTF-8 header is
        # a wrong key, not a server error)
        if scheme.lower() != BEARER or not hmac.compare_digest(credentials.encode("utf-8", "surrogateescape"),
                                                               key.encode()):
            raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with (--api-key-file, $BLINK_API_KEY or --api-key)",
                           code="invalid_api_key")

    @web.middleware
    async def _admit(self, request, handler):
        """Every POST (a generation request) counts as in flight until answered; once draining it gets 503."""
        if request.method != "POST":
            return await handler(request)
        with self.drain.admit():
            return await handler(request)

    async def _background(self, app):
        polling = asyncio.create_task(self.loop.run())
        polling.add_done_callback(self._loop_ended)
        tasks = [polling]
        if self.engine_gone is not None:
            tasks.append(asyncio.create_task(self._watch_engine()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool in self._tokenizing.values():
            pool.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The agent loop ends only when the server stops, or when it crashed (it logged why and failed the requests
        in flight): a server that can serve nothing more stops with ``exit_code`` 1, as when its engine is gone,
        rather than answer 503 for ever."""
        if not task.cancelled() and task.exception() is not None:
            log.error("the agent loop crashed: stopping (exit code 1)")
            self.exit_code = 1
            self.stopped.set()

    async def _watch_engine(self) -> None:
        while (reason := self.engine_gone()) is None:
            await asyncio.sleep(self.ENGINE_WATCH_S)
        log.error("%s: failing the requests in flight and stopping (exit code 1)", reason)
        self.loop.fail_all(reason)
        self.exit_code = 1
        self.stopped.set()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    def _model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "blink",
                "max_model_len": self.parser.context_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's "retrieve model": the served model's entry of /v1/models, 404 for any other id."""
        self.parser.check_model({"model": request.match_info["model"]})
        return web.json_response(self._model_card())

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        return vllm_json(await self._parse(request, self.tokenization.tokenize))

    async def detokenize(self, request: web.Request) -> web.Response:
        return vllm_json(await self._parse(request, self.tokenization.detokenize))

    async def health(self, request: web.Request) -> web.Response:
        problem = self.loop.health()
        if problem:
            raise ApiError(503, problem, retry_after_s=self.config.loop.retry_after_s)
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # -- one request -----------------------------------------------------------------------------------------------

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()      # the headers are in: a streamed answer's first chunk is timed from here
        parse = self.parser.chat if chat else self.parser.completion
        job = await self._parse(request, parse, cheap=lambda body: self.parser.cheap(body, chat))
        return await self._serve(request, job, arrival)

    async def _parse(self, request: web.Request, parse, cheap=lambda body: False):
        """``parse(body)`` of the request's JSON body: on the event loop when that is ``cheap`` (token ids), else in
        a tokenizer thread. A small body takes no place (``limits``)."""
        deadline = asyncio.get_running_loop().time() + self.config.limits.body_timeout_s
        small = is_small(request)
        if small:
            return await self._parse_body(request, parse, cheap, deadline, None, small)
        async with self.places.receiving(deadline) as granted:
            return await self._parse_body(request, parse, cheap, deadline, granted, small)

    async def _parse_body(self, request: web.Request, parse, cheap, deadline: float, rate_from: float | None,
                          small: bool):
        body = json_body(await read_body(request, self.config.limits, deadline, rate_from))
        if cheap(body):
            return parse(body)
        # A structured output may compile for long (--grammar-timeout): never in the thread small bodies share.
        pool = self._tokenizing[small and not structured.asks(body)]
        return await asyncio.get_running_loop().run_in_executor(pool, parse, body)

    async def _serve(self, request: web.Request, job: Job, arrival: float) -> web.StreamResponse:
        reqs = []
        answer = self.responder.streamed(job, reqs, arrival) if job.stream else None
        try:
            for params in job.choice_params():
                reqs.append(self.loop.submit(job.prompt, params, job.priority, answer))
            if answer is not None:
                return await self.responder.stream(request, answer)
            return await self.responder.complete(job, reqs)
        except RequestError as e:       # a limit of the ring the parser did not know of: nothing was queued
            raise api_error(e) from None
        finally:
            # Runs on disconnect too: aiohttp cancels the handler (handler_cancellation=True).
            for req in reqs:
                self.loop.close(req)


class Listening:
    """A server listening on a port: ``port``, and ``cleanup()`` to stop listening and close every connection."""

    def __init__(self, runner: web.AppRunner, listener: asyncio.Server):
        self.runner, self.listener = runner, listener
        self.port = listener.sockets[0].getsockname()[1]

    async def cleanup(self) -> None:
        self.listener.close()
        await self.runner.cleanup()


async def start(server: OpenAIServer, host: str, port: int, reuse_port: bool = False) -> Listening:
    """Serve ``server`` on ``host:port`` (0: any free port) in the running loop, every connection guarded;
    ``reuse_port``: beside a server's other agent processes (SO_REUSEPORT: the kernel spreads the connections)."""
    loop = asyncio.get_running_loop()
    # A refused body's rest is read and dropped for LINGER_S (aiohttp's default: 10 s), so that its client reads the
    # answer rather than a reset, and the connection is closed then.
    handling = {"access_log": None, "keepalive_timeout": server.config.limits.keepalive_timeout_s,
                "lingering_time": LINGER_S}
    runner = web.AppRunner(server.app, handler_cancellation=True, shutdown_timeout=ABORT_GRACE_S, **handling)
    await runner.setup()

    def protocol():         # aiohttp's (runner.server()), its own errors in OpenAI JSON
        return server.guard.protocol(JsonErrors(runner.server, loop=loop, **handling))

    try:
        listener = await loop.create_server(protocol, host, port, reuse_port=reuse_port)
    except OSError as e:
        await runner.cleanup()
        raise cannot_listen(host, port, e) from None
    return Listening(runner, listener)


def run(server: OpenAIServer, host: str, port: int, reuse_port: bool = False, listening=lambda: None) -> int:
    """Serve until SIGINT/SIGTERM (Ctrl-C) and a drain (``blink.nic.drain``: a second signal stops at once), or until
    the engine is gone; the process's exit code (0, or 1 when the engine is gone). The process's start-up heap is
    frozen first (``freeze_startup_heap``): ``run`` owns the process it serves in. ``reuse_port``: see ``start``;
    ``listening()`` is called once the server listens."""
    import signal

    freeze_startup_heap()

    async def serve() -> int:
        # The handlers before anything that awaits: a signal while the server starts then drains it once it listens
        # (asyncio.run's own SIGINT handler would cancel this task mid-start instead, and code that swallows the
        # cancellation would leave a server that ignored its Ctrl-C).
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, server.drain.signal, server.stopped.set)
        listener = await start(server, host, port, reuse_port)
        log.info("serving %s on http://%s:%d", server.config.model_name, host, listener.port)
        listening()
        try:
            await server.stopped.wait()
        finally:
            await listener.cleanup()
        return server.exit_code

    return asyncio.run(serve())


def freeze_startup_heap() -> None:
    """Keep every object alive now (torch, the tokenizer, the server: ~200k) out of the garbage collector's scans,
    after collecting what is garbage. They live as long as the process, and a full collection over them took 34-155 ms
    of the event loop that streams everyone's tokens (a 2-core box), against 0.01 ms once they were frozen."""
    gc.collect()
    gc.freeze()
    log.info("%d start-up objects kept out of the garbage collector's scans", gc.get_freeze_count())
