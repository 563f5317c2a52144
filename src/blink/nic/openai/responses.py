"""One request's answer in the OpenAI format: a JSON completion, or an SSE stream of chunks ending in ``[DONE]``.

``Responder`` turns the ``RequestOutput``s the agent loop delivers for a request into text (``TextStream``: the
incremental detokenizer, cut before the first stop string) and writes it; a stop string ends the request there.
"""
from __future__ import annotations

import json
import time
from contextlib import suppress
import uuid

from aiohttp import web

from blink.nic.agent_loop import Submission
from blink.nic.openai.errors import REFUSALS, api_error
from blink.nic.openai.requests import Job
from blink.nic.text import TextStream, Tokenizer


class Responder:
    """Writes the answers of one model's requests (``model_name`` is what the responses say they came from)."""

    def __init__(self, tokenizer: Tokenizer, model_name: str):
        self.tokenizer, self.model_name = tokenizer, model_name

    async def complete(self, job: Job, req: Submission) -> web.Response:
        text = TextStream(self.tokenizer, job.stop)
        content, tokens = "", []
        async for delta, new_tokens, _ in self._events(req, text):
            content += delta
            tokens += new_tokens
        choice = self._choice(job, content, tokens, req.finish_reason)
        return web.json_response({**self._head(job, chunk=False), "choices": [choice],
                                  "usage": self._usage(job, text)})

    async def stream(self, request: web.Request, job: Job, req: Submission) -> web.StreamResponse:
        """SSE: each batch of tokens is one chunk; every chunk formatted since the handler last woke (the tokens of
        every poll it slept through, and at the end the usage chunk and ``[DONE]``) goes out in one write."""
        text = TextStream(self.tokenizer, job.stop)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunks = ChunkFormat(self._head(job, chunk=True), job.chat)
        pending = []
        try:
            if job.chat:
                await response.write(chunks.role())
            async for delta, tokens, finish in self._events(req, text):
                if delta or finish:
                    pending.append(chunks.choice(delta, self._logprobs(job, tokens), finish))
                if finish and job.include_usage:
                    pending.append(chunks.usage(self._usage(job, text)))
                if finish:
                    pending.append(DONE)
                if pending and (finish or req.queue.empty()):
                    await response.write(b"".join(pending))
                    pending.clear()
        except REFUSALS as e:
            with suppress(ConnectionResetError):    # a client that left before the end is no error of the server's
                await response.write(b"".join([*pending, _event(api_error(e).body()), DONE]))
        except ConnectionResetError:
            pass                # the client left; the handler's finally cancels the request
        return response

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

    def _head(self, job: Job, *, chunk: bool) -> dict:
        if job.chat:
            kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name}

    def _choice(self, job: Job, text: str, tokens: list, finish: str | None) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if job.chat else {"text": text}
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


DONE = b"data: [DONE]\n\n"
_encode = json.JSONEncoder(ensure_ascii=False).encode     # json.dumps(value, ensure_ascii=False), built once


def _event(payload: dict) -> bytes:
    return b"data: " + _encode(payload).encode() + b"\n\n"


class ChunkFormat:
    """The SSE events of one streamed request, byte for byte ``data: json.dumps(chunk)``: the part every chunk
    shares (id, object, created, model) is encoded once, so a chunk costs the encoding of its text alone."""

    def __init__(self, head: dict, chat: bool):
        self.chat = chat
        shared = _encode(head)[:-1]         # without the closing brace
        self._choice = f'data: {shared}, "choices": [{{"index": 0, '.encode()
        self._usage = f'data: {shared}, "choices": [], "usage": '.encode()

    def role(self) -> bytes:
        """The chat stream's first event: the assistant's role, no content yet."""
        return self._choice + b'"delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": ' \
            b"null}]}\n\n"

    def choice(self, text: str, logprobs: dict | None, finish: str | None) -> bytes:
        if not self.chat:
            body = b'"text": ' + _json(text)
        else:
            body = b'"delta": {"content": ' + _json(text) + b"}" if text else b'"delta": {}'
        if logprobs is None and finish is None:
            return self._choice + body + _PLAIN_TAIL
        return (self._choice + body + b', "logprobs": ' + _json(logprobs) + b', "finish_reason": ' + _json(finish)
                + b"}]}\n\n")

    def usage(self, usage: dict) -> bytes:
        return self._usage + _json(usage) + b"}\n\n"


_PLAIN_TAIL = b', "logprobs": null, "finish_reason": null}]}\n\n'      # most chunks: no logprobs, not the last


def _json(value) -> bytes:
    return b"null" if value is None else _encode(value).encode()
