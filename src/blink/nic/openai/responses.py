"""One request's answer in the OpenAI format: a JSON completion, or an SSE stream of chunks ending in ``[DONE]``.

``Responder`` turns the ``RequestOutput``s the agent loop delivers for a request into text (``TextStream``: the
incremental detokenizer, cut before the first stop string) and writes it; a stop string ends the request there. A
chat that offers tools has its text read for calls (``tools.ToolAnswer``): streamed as tool-call deltas, whole as
the message those deltas add up to.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from contextlib import suppress

from aiohttp import web

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

    async def stream(self, request: web.Request, job: Job, reqs: list[Submission],
                     arrival: float | None = None) -> web.StreamResponse:
        """SSE: each batch of a choice's tokens is one chunk; every chunk formatted since the handler last woke (the
        tokens of every poll it slept through, and at the end the usage chunk and ``[DONE]``) goes out in one
        write. ``arrival``: when the request came (``time.monotonic()``), None to leave it untimed."""
        texts = [TextStream(self.tokenizer, job.stop) for _ in reqs]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunks = ChunkFormat(self._head(job, chunk=True), job.chat)
        pending = []
        answers = [_tool_answer(job) for _ in reqs]
        held = [[] for _ in reqs]       # tokens whose logprobs wait for a chunk (while text may be a call's)
        try:
            if job.chat:
                await response.write(chunks.role(len(reqs)))
            remaining = len(reqs)
            async for i, delta, tokens, finish, more in _merged(self._events, reqs, texts):
                if answers[i] is not None:
                    held[i] += tokens
                    pending += self._tool_chunks(chunks, job, i, answers[i], delta, held[i], finish)
                elif delta or finish:
                    pending.append(chunks.choice(i, delta, self._logprobs(job, tokens), finish))
                remaining -= finish is not None
                if not remaining and job.include_usage:
                    pending.append(chunks.usage(self._usage(job, texts)))
                if not remaining:
                    pending.append(DONE)
                if pending and not (remaining and more):
                    await response.write(b"".join(pending))
                    pending.clear()
                    if arrival is not None:
                        self.metrics.http_ttft.observe(time.monotonic() - arrival)
                        arrival = None
        except REFUSALS as e:
            with suppress(ConnectionResetError):    # a client that left before the end is no error of the server's
                await response.write(b"".join([*pending, event(api_error(e).body()), DONE]))
        except ConnectionResetError:
            pass                # the client left; the handler's finally cancels the requests
        return response

    async def _whole(self, req: Submission, text: TextStream) -> tuple[str, list]:
        content, tokens = "", []
        async for delta, new_tokens, _ in self._events(req, text):
            content += delta
            tokens += new_tokens
        return content, tokens

    async def _events(self, req: Submission, text: TextStream):
        """Yield ``(delta, [(token, logprob, top logprobs)], finish_reason)`` per batch of tokens; the last has a
        finish_reason."""
        while True:
            out = await req.queue.get()
            if isinstance(out, Exception):
                raise out
            delta, tokens = "", []
            for i, token in enumerate(out.new_tokens):
                delta += text.push(token)
                tokens.append((token, out.new_logprobs[i] if out.new_logprobs else None,
                               out.new_top_logprobs[i] if out.new_top_logprobs else None))
                if text.stopped:
                    break
            if text.stopped or out.finished:
                req.finish_reason = "stop" if text.stopped else out.finish_reason
                if text.stopped:
                    self.close(req)         # the ring stops generating for it now
                yield delta + text.finish(), tokens, req.finish_reason
                return
            yield delta, tokens, None

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


async def _merged(events, reqs: list[Submission], texts: list[TextStream]):
    """``(choice index, delta, tokens, finish_reason, more)`` of every choice's events, as they come (``more``:
    another event is ready now); an error of any choice ends the whole stream."""
    if len(reqs) == 1:                      # the common case: no tasks, no queue
        async for delta, tokens, finish in events(reqs[0], texts[0]):
            yield 0, delta, tokens, finish, not reqs[0].queue.empty()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def feed(i: int) -> None:
        try:
            async for event in events(reqs[i], texts[i]):
                queue.put_nowait((i, *event))
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(feed(i)) for i in range(len(reqs))]
    try:
        remaining = len(reqs)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            remaining -= item[3] is not None
            yield (*item, not queue.empty())
    finally:
        for task in tasks:
            task.cancel()
