"""``ChunkFormat`` against its reference: every event byte for byte ``data: json.dumps(chunk, ensure_ascii=False)``
of the chunk the OpenAI format defines."""
import json

import pytest

from blink.nic.openai.sse import DONE, ChunkFormat, event

HEAD = {"id": "chatcmpl-1f", "object": "chat.completion.chunk", "created": 1796167200, "model": "m \"q\" ü"}


def reference(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("index,text,logprobs,finish", [
    (0, "Paris", None, None), (2, "", None, "stop"), (0, "x", None, "length"),
    (1, "é \"\\\n😀", {"tokens": ["a"], "token_logprobs": [-0.5]}, None)])
def test_a_choice_chunk_is_json_dumps_of_the_chunk(chat, index, text, logprobs, finish):
    body = ({"delta": {"content": text} if text else {}} if chat else {"text": text})
    want = {**HEAD, "choices": [{"index": index, **body, "logprobs": logprobs, "finish_reason": finish}]}
    assert ChunkFormat(HEAD, chat).choice(index, text, logprobs, finish) == reference(want)


@pytest.mark.parametrize("n", [1, 3])
def test_the_role_chunk_names_every_choice(n):
    first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(n)]
    assert ChunkFormat(HEAD, True).role(n) == reference({**HEAD, "choices": first})


def test_usage_error_and_done_events():
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert ChunkFormat(HEAD, False).usage(usage) == reference({**HEAD, "choices": [], "usage": usage})
    error = {"error": {"message": "ä", "type": "server_error", "code": 503}}
    assert event(error) == reference(error)
    assert DONE == b"data: [DONE]\n\n"
