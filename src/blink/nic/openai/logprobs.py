"""OpenAI's logprobs objects for an answer's tokens, from ``(token, logprob, top)`` triples (``top``: the most
likely ``(token, logprob)`` pairs at that position, most likely first, or None).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. The
completions API: ``{"tokens", "token_logprobs"}``, and with a count ``logprobs: N > 0`` also ``"top_logprobs"``: per
token a dict of the N most likely tokens' strings and the sampled token's to their logprobs. A token's string is
its own decode (special tokens included) and its bytes that string's UTF-8 bytes, as vLLM gives them.
"""
from __future__ import annotations


def chat_logprobs(decode, tokens: list[tuple]) -> dict:
    return {"content": [{**_entry(decode, token, logprob),
                         "top_logprobs": [_entry(decode, t, lp) for t, lp in top or ()]}
                        for token, logprob, top in tokens]}


def completion_logprobs(decode, tokens: list[tuple], top_logprobs: int) -> dict:
    strings = [decode(token) for token, _, _ in tokens]
    body = {"tokens": strings, "token_logprobs": [logprob for _, logprob, _ in tokens]}
    if top_logprobs:
        body["top_logprobs"] = [{**{decode(t): lp for t, lp in top}, string: logprob}
                                for string, (_, logprob, top) in zip(strings, tokens, strict=True)]
    return body


def _entry(decode, token: int, logprob: float) -> dict:
    text = decode(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}
