"""OpenAI-compatible HTTP front of the agent: the aiohttp app (``OpenAIServer``) with its routes for completions,
chat, SSE streaming, models, health and metrics; its ``ServerConfig``; and the entry points ``start`` and ``run``.

One asyncio event loop owns the ``Agent`` (which is not thread-safe). HTTP handlers validate the request and tokenize
it (``blink.nic.requests``) and hand it to the ``AgentLoop`` (``blink.nic.agent_loop``); its one background task polls
the ring and fans the new tokens out to per-request queues; each handler detokenizes its tokens (``TextStream``) and
writes JSON or SSE. Every request a handler submits it closes when it leaves, whatever the reason; every error,
aiohttp's own included, leaves as an OpenAI-style body, and the server keeps serving everyone else.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from blink.errors import EngineUnavailable, Overloaded, RequestError
from blink.nic.agent import Agent
from blink.nic.agent_loop import AgentLoop, LoopConfig, Metrics, Submission
from blink.nic.openai.requests import ApiError, Job, Parser, json_body
from blink.nic.text import TextStream, Tokenizer

log = logging.getLogger("blink.server")


@dataclass(frozen=True)
class ServerConfig:
    """``model_name``: the name clients use; ``loop``: the agent loop's bounds and timing (``LoopConfig``: the wait
    queue beyond which requests get 429). /health fails and requests get 503 while the agent's ``Liveness`` says
    the engine is not serving."""

    model_name: str
    loop: LoopConfig = LoopConfig()


def api_error(error: Exception) -> ApiError:
    """The HTTP form of an agent-loop refusal: 503 for an unavailable engine, 429 for a full server."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, EngineUnavailable):
        return ApiError(503, str(error), retry_after_s=error.retry_after_s)
    if isinstance(error, Overloaded):
        return ApiError(429, str(error), retry_after_s=error.retry_after_s)
    raise TypeError(f"no HTTP form for {error!r}")


@web.middleware
async def _errors(request, handler):
    """Every error leaves as an OpenAI-style JSON body, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except (ApiError, EngineUnavailable, Overloaded) as e:
        return api_error(e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, f"{e.reason}: {request.method} {request.path}").response()
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return ApiError(500, "internal server error (see the server log)").response()


class OpenAIServer:
    """The aiohttp application (``.app``) serving one model through one ``Agent``."""

    ENGINE_WATCH_S = 0.5

    def __init__(self, agent: Agent, tokenizer: Tokenizer, config: ServerConfig, engine_gone=None):
        """``engine_gone()``, if given, says why the engine is gone for good (its process exited), or None; the
        server then fails what is in flight and stops with ``exit_code`` 1, for a supervisor to restart it."""
        self.tokenizer, self.config, self.engine_gone = tokenizer, config, engine_gone
        self.exit_code = 0
        self.stopped = asyncio.Event()
        self.parser = Parser(tokenizer, config.model_name, agent)
        self.metrics = Metrics()
        self.loop = AgentLoop(agent, self.metrics, config.loop)
        self.metrics.watch(self.loop)
        self.created = int(time.time())
        self.app = web.Application(middlewares=[_errors])
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.get("/metrics", self.metrics_text)])
        self.app.cleanup_ctx.append(self._poller)

    async def _poller(self, app):
        tasks = [asyncio.create_task(self.loop.run())]
        if self.engine_gone is not None:
            tasks.append(asyncio.create_task(self._watch_engine()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_engine(self) -> None:
        while (reason := self.engine_gone()) is None:
            await asyncio.sleep(self.ENGINE_WATCH_S)
        log.error("%s: failing the requests in flight and stopping (exit code 1)", reason)
        self.loop.fail_all(reason)
        self.exit_code = 1
        self.stopped.set()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.parser.completion(await json_body(request)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.parser.chat(await json_body(request)))

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "blink",
                 "max_model_len": self.parser.context_len}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        problem = self.loop.health()
        if problem:
            raise ApiError(503, problem, retry_after_s=self.config.loop.retry_after_s)
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # -- one request -----------------------------------------------------------------------------------------------

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        try:
            req = self.loop.submit(job.prompt, job.params, job.priority)
        except RequestError as e:       # a limit of the ring the parser did not know of: nothing was queued
            raise ApiError(400, str(e), param=e.field) from None
        text = TextStream(self.tokenizer, job.stop)
        try:
            if job.stream:
                return await self._stream(request, job, req, text)
            return await self._complete(job, req, text)
        finally:
            # Runs on disconnect too: aiohttp cancels the handler (handler_cancellation=True).
            self.loop.close(req)

    async def _events(self, req: Submission, text: TextStream):
        """Yield ``(delta, [(token, logprob)], finish_reason)`` per batch of tokens; the last has a finish_reason."""
        while True:
            out = await req.queue.get()
            if isinstance(out, Exception):
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

    async def _complete(self, job: Job, req: Submission, text: TextStream) -> web.Response:
        content, tokens = "", []
        async for delta, new_tokens, _ in self._events(req, text):
            content += delta
            tokens += new_tokens
        choice = self._choice(job, content, tokens, req.finish_reason, chunk=False)
        return web.json_response({**self._head(job, chunk=False), "choices": [choice],
                                  "usage": self._usage(job, text)})

    async def _stream(self, request: web.Request, job: Job, req: Submission, text: TextStream) -> web.StreamResponse:
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
        except (ApiError, EngineUnavailable) as e:
            await _send(response, api_error(e).body())
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


def run(server: OpenAIServer, host: str, port: int) -> int:
    """Serve until SIGINT/SIGTERM (Ctrl-C), or until the engine is gone; the process's exit code."""
    import signal

    async def serve() -> int:
        runner, bound = await start(server, host, port)
        log.info("serving %s on http://%s:%d", server.config.model_name, host, bound)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, server.stopped.set)
        try:
            await server.stopped.wait()
        finally:
            await runner.cleanup()
        return server.exit_code

    return asyncio.run(serve())
