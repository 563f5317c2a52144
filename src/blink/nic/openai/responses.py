"""One request's answer in the OpenAI format: a JSON completion, or an SSE stream of chunks ending in ``[DONE]``.

``Responder`` turns the ``RequestOutput``s the agent loop delivers for a request into text (``TextStream``: the
incremental detokenizer, cut before the first stop string) and writes it; a stop string ends the request there. A
chat that offers tools has its text read for calls (``tools.ToolAnswer``): streamed as tool-call deltas, whole as
the message those deltas add up to. A stream is a ``StreamedAnswer``, the agent loop's ``Reader`` of its requests:
the polling task formats each poll's tokens and writes them to the connection itself, so a token costs no wake-up
of the stream's handler, which waits for the end (or for a slow client to read again).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from aiohttp import web

from blink.nic.agent import RequestOutput
from blink.nic.agent_loop import Submission
from blink.nic.metrics import Metrics
from blink.nic.openai.errors import REFUSALS, api_error
from blink.nic.openai.logprobs import chat_logprobs, completion_logprobs
from blink.nic.openai.requests import Job
from blink.nic.openai.sse import DONE, ChunkFormat, event
from blink.nic.openai.tools import ToolAnswer, message
from blink.nic.text import TextStream, Tokenizer


class Responder:
    """Writes the answers of one model's requests (``model_name`` is what the responses say they came from). A
    request of ``n`` choices is ``n`` ring requests, one per choice, in choice order. A stream's first token's
    chunk, once written, is timed from the request's arrival into ``metrics.http_ttft``. ``close`` ends a ring
    request the answer needs no more of (the agent loop's ``close``): a choice that met a stop string is closed at
    once, not when its sibling choices end."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, metrics: Metrics, close: Callable[[Submission], None]):
        self.tokenizer, self.model_name, self.metrics, self.close = tokenizer, model_name, metrics, close

    async def complete(self, job: Job, reqs: list[Submission]) -> web.Response:
        texts = [TextStream(self.tokenizer, job.stop) for _ in reqs]
        answers = await asyncio.gather(*(self._whole(req, text) for req, text in zip(reqs, texts, strict=True)))
        choices = [self._choice(job, i, content, tokens, req.finish_reason)
                   for i, ((content, tokens), req) in enumerate(zip(answers, reqs, strict=True))]
        return web.json_response({**self._head(job, chunk=False), "choices": choices,
                                  "usage": self._usage(job, texts)})

    def streamed(self, job: Job, reqs: list[Submission], arrival: float | None = None) -> StreamedAnswer:
        """The reader of a streamed answer's ring requests: ``reqs``, its choices' requests in choice order, each
        appended as it is submitted with this reader. ``arrival``: when the request came (``time.monotonic()``),
        None to leave it untimed."""
        return StreamedAnswer(self, job, reqs, arrival)

    async def stream(self, request: web.Request, answer: StreamedAnswer) -> web.StreamResponse:
        """SSE: sends the headers, then waits while the polling task writes the chunks (``StreamedAnswer``), until
        ``[DONE]`` is out or the client has left; while the client reads too slowly, writes what waits for it each
        time its connection drains."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        writer = await response.prepare(request)
        if request.transport is None:
            return response         # the client left as the headers went out; the handler's finally cancels
        answer.attach(request.transport, writer.chunked)
        while not answer.ended or answer.backlog:
            await answer.wake.wait()
            answer.wake.clear()
            if answer.error is not None:
                raise answer.error
            if answer.backlog:
                try:
                    await writer.drain()
                except ConnectionResetError:
                    break           # the client left; the handler's finally cancels the requests
                answer.backlog = False
                answer.flush()
        return response

    async def _whole(self, req: Submission, text: TextStream) -> tuple[str, list]:
        content, tokens = "", []
        while True:
            out = await req.queue.get()
            if isinstance(out, Exception):
                raise out
            delta, new_tokens, finish = self.advance(req, text, out)
            content += delta
            tokens += new_tokens
            if finish is not None:
                return content, tokens

    def advance(self, req: Submission, text: TextStream, out: RequestOutput) -> tuple[str, list, str | None]:
        """``req``'s next output ``out`` through its ``text``: ``(delta, [(token, logprob, top logprobs)],
        finish_reason)``, the tokens only where logprobs are asked for; the finish reason is None while the request
        goes on. A stop string ends it here: the ring request is closed (the ring stops generating for it now)."""
        delta, tokens = "", []
        for i, token in enumerate(out.new_tokens):
            delta += text.push(token)
            if out.new_logprobs is not None:
                tokens.append((token, out.new_logprobs[i],
                               out.new_top_logprobs[i] if out.new_top_logprobs else None))
            if text.stopped:
                break
        if text.stopped or out.finished:
            req.finish_reason = "stop" if text.stopped else out.finish_reason
            if text.stopped:
                self.close(req)
            return delta + text.finish(), tokens, req.finish_reason
        return delta, tokens, None

    def _head(self, job: Job, *, chunk: bool) -> dict:
        if job.chat:
            kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name}

    def _tool_chunks(self, chunks: ChunkFormat, job: Job, i: int, answer: ToolAnswer, text: str, held: list,
                     finish: str | None) -> list[bytes]:
        """Choice ``i``'s chunks for its next ``text``: one per delta, the first with the logprobs of the ``held``
        tokens (then let go), the last with the finish reason."""
        deltas = answer.deltas(text, final=finish is not None)
        if finish is not None:
            deltas, finish = deltas or [{}], answer.finish_reason(finish)
        out = []
        for k, delta in enumerate(deltas):
            out.append(chunks.delta(i, delta, self._logprobs(job, held) if k == 0 else None,
                                    finish if k == len(deltas) - 1 else None))
        if deltas:
            held.clear()
        return out

    def _choice(self, job: Job, index: int, text: str, tokens: list, finish: str | None) -> dict:
        answer = _tool_answer(job)
        if answer is not None:
            body = {"message": message(answer.deltas(text, final=True))}
            finish = answer.finish_reason(finish)
        else:
            body = {"message": {"role": "assistant", "content": text}} if job.chat else {"text": text}
        return {"index": index, **body, "logprobs": self._logprobs(job, tokens), "finish_reason": finish}

    def _logprobs(self, job: Job, tokens: list) -> dict | None:
        if not job.params.logprobs:
            return None
        if job.chat:
            return chat_logprobs(self._token_text, tokens)
        return completion_logprobs(self._token_text, tokens, job.params.top_logprobs)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _usage(self, job: Job, texts: list[TextStream]) -> dict:
        n_prompt, n_completion = len(job.prompt), sum(text.n_tokens for text in texts)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _tool_answer(job: Job) -> ToolAnswer | None:
    """A reader of one choice's tool calls, or None when its text is all content."""
    parser = job.tools.parser() if job.tools is not None else None
    return ToolAnswer(parser) if parser is not None else None


class StreamedAnswer:
    """One streamed answer: the agent loop's ``Reader`` of its choices' ring requests, which turns each poll's
    outputs into SSE chunks and writes them to the connection, from the polling task, one write per poll (every
    choice's chunks, and at the end the usage chunk and ``[DONE]``) in HTTP/1.1's chunked framing where the
    response has it, as aiohttp's writer frames a ``write``. The handler (``Responder.stream``) sends the headers,
    ``attach``es the connection (chunks that came before go out then) and waits on ``wake``: set once the answer
    has ``ended`` ([DONE] formatted, or the client gone), for an ``error`` to raise, or for a ``backlog``.

    Back-pressure: a connection that holds more unsent bytes than its transport's high-water mark (a client that
    reads too slowly) is not written to from the polling task, which must not wait for one stream; its chunks wait
    in ``pending`` and the handler writes them each time the connection drains (``backlog``), so the other streams
    go on. Invariant: chunks go out in the order they were formatted, each exactly once."""

    def __init__(self, responder: Responder, job: Job, reqs: list[Submission], arrival: float | None):
        self.responder, self.job, self.reqs, self.arrival = responder, job, reqs, arrival
        self.texts = [TextStream(responder.tokenizer, job.stop) for _ in range(job.n)]
        self.answers = [_tool_answer(job) for _ in range(job.n)]
        self.held = [[] for _ in range(job.n)]      # tokens whose logprobs wait for a chunk (text may be a call's)
        self.chunks = ChunkFormat(responder._head(job, chunk=True), job.chat)
        self.pending: list[bytes] = [self.chunks.role(job.n)] if job.chat else []
        self.remaining = job.n          # choices not finished
        self.untimed = False            # an output's chunk is pending, and none was written yet
        self.wake = asyncio.Event()
        self.ended = False
        self.error: Exception | None = None
        self.backlog = False
        self._transport: asyncio.Transport | None = None
        self._chunked = False
        self._high_water = 0

    def attach(self, transport: asyncio.Transport, chunked: bool) -> None:
        """The headers are out on ``transport``: write what is pending, and every poll's chunks from now on."""
        self._transport, self._chunked = transport, chunked
        self._high_water = transport.get_write_buffer_limits()[1]
        self.flush()

    def take(self, req: Submission, item: RequestOutput | Exception) -> None:
        if self.ended:
            return
        self.untimed = self.arrival is not None
        try:
            if isinstance(item, Exception):
                raise item
            self._format(self.reqs.index(req), req, item)
        except REFUSALS as e:       # the engine stopped serving: the stream ends with the error's event
            self.pending += [event(api_error(e).body()), DONE]
            self._end()
        except Exception as e:      # a bug: the handler raises it (the server logs it and goes on)
            self.error = e
            self._end()

    def _format(self, i: int, req: Submission, out: RequestOutput) -> None:
        responder, job = self.responder, self.job
        delta, tokens, finish = responder.advance(req, self.texts[i], out)
        answer = self.answers[i]
        if answer is not None:
            self.held[i] += tokens
            self.pending += responder._tool_chunks(self.chunks, job, i, answer, delta, self.held[i], finish)
        elif delta or finish:
            self.pending.append(self.chunks.choice(i, delta, responder._logprobs(job, tokens), finish))
        if finish is None:
            return
        self.remaining -= 1
        if not self.remaining:
            if job.include_usage:
                self.pending.append(self.chunks.usage(responder._usage(job, self.texts)))
            self.pending.append(DONE)
            self._end()

    def flush(self) -> None:
        """Write what is pending, in one write, unless the headers are not out yet or the connection is backed up
        (then wake the handler, which writes it once the connection drains)."""
        transport = self._transport
        if not self.pending or transport is None or self.backlog:
            return
        if transport.is_closing():      # the client left: nobody reads what is pending
            self.pending.clear()
            self._end()
            return
        if transport.get_write_buffer_size() > self._high_water:
            self.backlog = True
            self.wake.set()
            return
        data = b"".join(self.pending)
        self.pending.clear()
        try:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        except Exception as e:      # the handler raises it: the polling task serves every other stream
            self.error = e
            self._end()
            return
        if self.untimed:
            self.responder.metrics.http_ttft.observe(time.monotonic() - self.arrival)
            self.arrival, self.untimed = None, False

    def _end(self) -> None:
        self.ended = True
        self.wake.set()
