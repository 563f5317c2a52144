"""What the Python API returns: ``GenerationOutput`` (a finished request), ``StreamDelta`` (one step of a stream),
and ``OutputBuilder``, which turns one request's ring outputs into them (text, stop strings) for ``Engine`` and
``AsyncEngine`` alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from blink.ring.request import SamplingParams


@dataclass
class GenerationOutput:
    """One finished request. ``text`` is None when the model directory has no tokenizer."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None     # "stop", "length", "abort" or "error"
    logprobs: list[float] | None = None
    # With ``top_logprobs``: per token, the (token id, logprob) of the most likely tokens, most likely first.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class StreamDelta:
    """What one request produced since the previous delta; the last one carries the finish reason."""

    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class OutputBuilder:
    """One request's output, built from the ``RequestOutput``s the agent polls for it.

    Text is decoded incrementally (``blink.nic.text.TextStream``) and cut before the first of ``params.stop``; a stop
    string ends the request with "stop", keeping the tokens up to the one that completed it. Then ``stopped`` is
    True and the caller cancels the request's ring slot. Without a tokenizer there is no text, and stop strings are
    refused when the request is made.
    """

    def __init__(self, prompt: list[int], params: SamplingParams, tokenizer):
        from blink.nic.text import TextStream

        if params.stop and tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to match text: this model directory has no "
                             "tokenizer.json (use stop_token_ids)")
        self.output = GenerationOutput(list(prompt), logprobs=[] if params.logprobs else None,
                                       top_logprobs=[] if params.top_logprobs else None)
        self._text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
        if self._text is not None:
            self.output.text = ""
        self.stopped = False

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def push(self, out) -> StreamDelta:
        """Fold one poll's tokens in (the agent's ``RequestOutput``); the delta they add (the last delta carries the
        finish reason)."""
        new_tokens, new_logprobs, new_top, finish_reason = (out.new_tokens, out.new_logprobs, out.new_top_logprobs,
                                                            out.finish_reason)
        text = None
        if self._text is not None:
            text, kept = "", 0
            for token in new_tokens:
                text += self._text.push(token)
                kept += 1
                if self._text.stopped:
                    break
            if self._text.stopped:
                self.stopped = True
                finish_reason = "stop"
                new_tokens = new_tokens[:kept]
                new_logprobs = new_logprobs[:kept] if new_logprobs is not None else None
                new_top = new_top[:kept] if new_top is not None else None
            if finish_reason is not None:
                text += self._text.finish()
            self.output.text += text
        self.output.token_ids += new_tokens
        if new_logprobs is not None and self.output.logprobs is not None:
            self.output.logprobs += new_logprobs
        if new_top is not None and self.output.top_logprobs is not None:
            self.output.top_logprobs += new_top
        self.output.finish_reason = finish_reason
        return StreamDelta(list(new_tokens), text, new_logprobs, finish_reason, new_top)
