"""vLLM's tokenizer endpoints: ``POST /tokenize`` turns a prompt or chat messages into the token ids the server feeds
the model for them, ``POST /detokenize`` token ids into text. The bodies are vLLM's: ``TokenizeCompletionRequest``
{model, prompt, add_special_tokens, return_token_strs} or ``TokenizeChatRequest`` {model, messages, tools,
add_generation_prompt, return_token_strs, ...} -> ``TokenizeResponse`` {count, max_model_len, tokens, token_strs};
``DetokenizeRequest`` {model, tokens} -> ``DetokenizeResponse`` {prompt}; the answers are written as vLLM's server
writes them (compact UTF-8 JSON, fields in its order).

Unlike a generation request, a prompt longer than the server accepts is counted, not refused: clients ask /tokenize
whether a prompt fits (``max_model_len`` is in the answer)."""
from __future__ import annotations

import json

from aiohttp import web

from blink.nic.openai.errors import ApiError
from blink.nic.openai.messages import chat_messages, text_field
from blink.nic.openai.requests import Parser, are_tokens, body_field, chat_prompt, refuse_unsupported
from blink.nic.openai.tools import tool_list
from blink.ring.request import shown

# TokenizeChatRequest's fields this server accepts only at their neutral values (its chat completions have none of
# them: /tokenize answers what /v1/chat/completions would feed the model).
CHAT_UNSUPPORTED = {"continue_final_message": (False,), "add_special_tokens": (False,), "chat_template": (),
                    "chat_template_kwargs": ({},), "mm_processor_kwargs": ({},),
                    "media_io_kwargs": ({},)}


class Tokenization:
    """The two endpoints' work on parsed bodies, for one model (``parser``: its tokenizer, name and limits)."""

    def __init__(self, parser: Parser):
        self.parser = parser
        self.tokenizer = parser.tokenizer

    def tokenize(self, body: dict) -> dict:
        """A ``TokenizeResponse``: a body with ``messages`` is a chat, else ``prompt`` is the text."""
        self.parser.check_model(body)
        if "messages" in body:
            refuse_unsupported(body, CHAT_UNSUPPORTED)
            ids = chat_prompt(self.tokenizer, chat_messages(body["messages"]), body, tool_list(body) or None)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, f"'prompt' must be a string, or send 'messages' to tokenize a chat "
                                    f"(got {shown(prompt)})", param="prompt")
            special = body_field(body, "add_special_tokens", (bool,), "a boolean", True)
            ids = self.tokenizer.encode(text_field(prompt, "prompt"), add_special_tokens=special)
        strs = body_field(body, "return_token_strs", (bool,), "a boolean", False)
        return {"count": len(ids), "max_model_len": self.parser.context_len, "tokens": ids,
                "token_strs": self.tokenizer.token_strs(ids) if strs else None}

    def detokenize(self, body: dict) -> dict:
        """A ``DetokenizeResponse``: the text of ``tokens``, special tokens included (as vLLM decodes them)."""
        self.parser.check_model(body)
        vocab = self.tokenizer.vocab_size
        tokens = body_field(body, "tokens", (list,), f"a list of token ids in [0, {vocab})", None,
                            lambda v: are_tokens(v, vocab))
        if tokens is None:
            raise ApiError(400, "'tokens' is required: the list of token ids to turn into text", param="tokens")
        return {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)}


def vllm_json(content: dict) -> web.Response:
    """``content`` as vLLM's server writes JSON (Starlette's ``JSONResponse``): compact, UTF-8, no NaN."""
    text = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
    return web.Response(body=text.encode("utf-8"), content_type="application/json")
