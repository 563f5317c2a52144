"""OpenAI request bodies (/v1/completions, /v1/chat/completions) parsed and validated into ``Job``s.

Bad input never reaches the ring: it gets a 4xx with an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}``, whose message says what was wrong and what to do.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from blink.errors import RequestError
from blink.nic.agent import Agent
from blink.nic.defaults import SamplingDefaults
from blink.nic.grammars import GrammarCompiler
from blink.nic.openai import structured
from blink.nic.openai.errors import ApiError
from blink.nic.openai.messages import chat_messages, text_field
from blink.nic.openai.tool_parsers import detect
from blink.nic.openai.tools import ToolFields, ToolRequest
from blink.nic.text import Tokenizer, max_tokens_for
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS, MAX_TOP_LOGPROBS
from blink.ring.request import BIAS_LIMIT, PENALTY_LIMIT, SamplingParams, shown

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # the OpenAI API's default for /v1/completions; chat defaults to the room left
MAX_CHOICES = 16                      # n: choices per request, each its own ring request
MAX_STOP_STRINGS = 16
PENALTY_RULE = f"a number in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}] (0: none)"   # presence and frequency penalties
# Accepted only at their neutral values: anything else asks for a feature this server does not have.
UNSUPPORTED = {"echo": (False,), "suffix": ("",), "best_of": (1,), "min_tokens": (0,)}
COMPLETION_UNSUPPORTED = {**UNSUPPORTED, "tools": ([],)}     # chat's tools: blink.nic.openai.tools
# The server option that sizes what the ring keeps of a request (RingGeometry's field of the same name).
RING_OPTIONS = {"max_top_logprobs": "--max-top-logprobs", "max_logit_bias": "--max-logit-bias"}


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
    n: int = 1                  # choices: n ring requests, seeds seed, seed + 1, ... when a seed is given
    tools: ToolRequest | None = None    # chat: the functions offered, how the answer calls them

    def choice_params(self) -> list[SamplingParams]:
        """The sampling of each choice: the request's, with consecutive seeds (one random seed each if none)."""
        if self.params.seed is None:
            return [self.params] * self.n
        return [replace(self.params, seed=(self.params.seed + i) % 2**64) for i in range(self.n)]


def json_body(raw: bytes) -> dict:
    """A request body as the JSON object it must be (400 saying what is wrong otherwise)."""
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


def _unbatched(prompt):
    """A completion's ``prompt`` without the one-element batch around it, if it has one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def body_field(body: dict, name: str, kinds: tuple, rule: str, default=None, ok=lambda v: True):
    """``body[name]`` checked to be one of ``kinds`` (bool only if listed) and ``ok``; ``default`` if absent/null."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds) or not ok(value):
        raise ApiError(400, f"'{name}' must be {rule} (got {shown(value)})", param=name)
    return value


def refuse_unsupported(body: dict, neutral_values: dict) -> None:
    """400 for a field of ``neutral_values`` (name -> the values that ask for nothing) set to anything else."""
    for name, neutral in neutral_values.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise ApiError(400, f"'{name}' is not supported by this server (got {shown(value)}): leave it out",
                           param=name)


class Parser:
    """Turns request bodies into ``Job``s against one model and one ring's limits; ``grammars`` compiles their
    structured outputs (None: the ring has no grammars region, and they are refused); ``tool_call_parser`` names the
    format the model writes tool calls in (``tool_parsers.FORMATS``; None: the one its chat template teaches, if
    known)."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, agent: Agent,
                 defaults: SamplingDefaults = SamplingDefaults(), grammars: GrammarCompiler | None = None,
                 tool_call_parser: str | None = None):
        g = agent.geometry
        self.structured = structured.StructuredParser(grammars)
        self.tools = ToolFields(tool_call_parser or detect(tokenizer.chat_template), tokenizer.renders_tools)
        self.tokenizer, self.model_name, self.geometry, self.defaults = tokenizer, model_name, g, defaults
        self.context_len = g.max_model_len         # the engine's limit, which the ring's creator wrote
        self.max_prompt = min(g.max_prompt_tokens, self.context_len - 1)
        # Text longer than this cannot tokenize to max_prompt tokens or fewer: refused before tokenizing (a 1 MB
        # prompt took 0.5 s of tokenizer time to find out). Below the body's cap wherever max_prompt is below
        # 1 MiB / max_token_bytes (12,945 for SmolLM2; the bound was 4 times looser, above the cap: it never fired).
        self.max_text_bytes = self.max_prompt * tokenizer.max_token_bytes
        # More messages than this cannot render to max_prompt tokens or fewer: refused before the template.
        self.max_messages = 1 + (self.max_prompt - 1) // tokenizer.message_tokens

    def completion(self, body: dict) -> Job:
        prompt = self._completion_prompt(body.get("prompt"))
        # The legacy API's logprobs is a count: the sampled token's, and that many most likely tokens'.
        logprobs = body_field(body, "logprobs", (int,), f"an integer in [0, {MAX_TOP_LOGPROBS}] or null", None,
                          lambda v: 0 <= v <= MAX_TOP_LOGPROBS)
        self._fits_ring("logprobs", logprobs or 0, "max_top_logprobs", "top logprobs per token")
        return self._job(body, prompt, chat=False, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                         max_tokens_field="max_tokens",
                         default_max=self.defaults.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)

    def chat(self, body: dict) -> Job:
        messages = self._messages(body.get("messages"))
        tools = self.tools.request(body)
        prompt = chat_prompt(self.tokenizer, messages, body, list(tools.tools) if tools else None)
        top = body_field(body, "top_logprobs", (int,), f"an integer in [0, {MAX_TOP_LOGPROBS}] or null", 0,
                         lambda v: 0 <= v <= MAX_TOP_LOGPROBS)
        logprobs = body_field(body, "logprobs", (bool,), "a boolean", False)
        if top and not logprobs:
            raise ApiError(400, "'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        # The newer name wins where both are given; a null one counts as absent, as everywhere in a body.
        new_name = body.get("max_completion_tokens") is not None
        self._fits_ring("top_logprobs", top, "max_top_logprobs", "top logprobs per token")
        return self._job(body, prompt, chat=True, logprobs=logprobs, top_logprobs=top, tools=tools,
                         max_tokens_field="max_completion_tokens" if new_name else "max_tokens",
                         default_max=self.defaults.max_tokens)

    def _fits_ring(self, name: str, count: int, geometry_field: str, what: str) -> None:
        """400 naming the field and the server option, unless the ring keeps ``count`` of what ``name`` asks for."""
        room = getattr(self.geometry, geometry_field)
        if count > room:
            raise ApiError(400, f"'{name}' asks for {count} {what}, but this server keeps at most {room}: start it "
                                f"with {RING_OPTIONS[geometry_field]} {count} (or more)", param=name)

    def _job(self, body: dict, prompt: list[int], *, chat: bool, logprobs: bool, top_logprobs: int,
             max_tokens_field: str, default_max, tools: ToolRequest | None = None) -> Job:
        self.check_model(body)
        refuse_unsupported(body, UNSUPPORTED if chat else COMPLETION_UNSUPPORTED)
        n = body_field(body, "n", (int,), f"an integer in [1, {MAX_CHOICES}]", 1, lambda v: 1 <= v <= MAX_CHOICES)
        if len(prompt) > self.max_prompt:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens but this server accepts at most "
                                f"{self.max_prompt}: shorten it", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if logprobs and not self.geometry.logprobs:
            raise ApiError(400, "logprobs are not available: the ring was built without a logprobs area",
                           param="logprobs")
        stream = body_field(body, "stream", (bool,), "a boolean", False)
        options = body_field(body, "stream_options", (dict,), "an object like {\"include_usage\": true}", {})
        if options and not stream:
            raise ApiError(400, "'stream_options' is only for streamed answers: send \"stream\": true, or leave it "
                                "out", param="stream_options")
        include_usage = body_field(options, "include_usage", (bool,), "a boolean", False)
        priority = body_field(body, "priority", (int,), "an integer in [-2**31, 2**31)", 0,
                          lambda v: -2**31 <= v < 2**31)
        params = self._sampling(body, len(prompt), max_tokens_field, default_max, logprobs, top_logprobs, tools)
        return Job(chat, prompt, params, self._stop(body), stream, include_usage, priority, n, tools)

    def _sampling(self, body, prompt_len: int, max_tokens_field: str, default_max: int | None,
                  logprobs: bool, top_logprobs: int, tools: ToolRequest | None) -> SamplingParams:
        requested = body_field(body, max_tokens_field, (int,), "an integer >= 1", None, lambda v: v >= 1)
        try:
            room = max_tokens_for(requested, prompt_len, self.context_len, self.geometry.max_output_tokens,
                                  max_tokens_field)
        except ValueError as e:
            raise ApiError(400, str(e), param=max_tokens_field, code="context_length_exceeded") from None
        if requested is None and default_max is not None:
            room = min(room, default_max)
        vocab = self.tokenizer.vocab_size
        stop_ids = body_field(body, "stop_token_ids", (list,),
                          f"a list of at most {self.geometry.max_stop_ids} token ids in [0, {vocab})", [],
                          lambda v: len(v) <= self.geometry.max_stop_ids and are_tokens(v, vocab))
        seed = body_field(body, "seed", (int,), "an integer in [-2**63, 2**64)", None, lambda v: -2**63 <= v < 2**64)
        top_k = body_field(body, "top_k", (int,), "an integer >= -1 (-1 or 0: no top-k)", self.defaults.top_k,
                       lambda v: v >= -1)
        sampling = dict(top_k=max(top_k, 0), seed=None if seed is None else seed % 2**64, logprobs=logprobs,
                        top_logprobs=top_logprobs, logit_bias=self._logit_bias(body.get("logit_bias")),
                        min_p=body_field(body, "min_p", (int, float), "a number in [0, 1] (0: none)", 0.0,
                                     lambda v: 0 <= v <= 1),
                        grammar=self.structured.grammar(body, tools.forced() if tools else None),
                        num_speculative_tokens=body_field(
                            body, "num_speculative_tokens", (int,),
                            f"an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0: no drafts for this request)", None,
                            lambda v: 0 <= v <= MAX_SPECULATIVE_TOKENS))
        try:
            return self._params(body, room, stop_ids, sampling)
        except RequestError as e:    # a value the parser's type checks let through but the ring cannot store
            raise ApiError(400, str(e).replace(f"SamplingParams.{e.field}", f"'{e.field}'"), param=e.field) from None

    def _params(self, body, room: int, stop_ids, sampling: dict) -> SamplingParams:
        return SamplingParams(
            **sampling,
            max_tokens=room,
            temperature=body_field(body, "temperature", (int, float), "a number >= 0 (0: greedy)",
                               self.defaults.temperature, lambda v: 0 <= v < math.inf),
            top_p=body_field(body, "top_p", (int, float), "a number in (0, 1]", self.defaults.top_p,
                         lambda v: 0 < v <= 1),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=body_field(body, "ignore_eos", (bool,), "a boolean", False),
            presence_penalty=body_field(body, "presence_penalty", (int, float), PENALTY_RULE, 0.0, _in_penalty_range),
            frequency_penalty=body_field(body, "frequency_penalty", (int, float), PENALTY_RULE, 0.0, _in_penalty_range),
            repetition_penalty=body_field(body, "repetition_penalty", (int, float), "a number > 0 (1: none)",
                                      self.defaults.repetition_penalty, lambda v: 0 < v < math.inf))

    def _logit_bias(self, value) -> dict[int, float] | None:
        """OpenAI's ``logit_bias``: token ids (as JSON object keys, decimal strings) in the vocabulary, to numbers in
        [-100, 100]; as many as the ring keeps."""
        vocab = self.tokenizer.vocab_size
        rule = (f"an object mapping token ids in [0, {vocab}) (as strings) to numbers in [-{BIAS_LIMIT}, "
                f"{BIAS_LIMIT}]")
        bias = body_field({"logit_bias": value}, "logit_bias", (dict,), rule, None, lambda v: all(
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 12 and int(k) < vocab and _is_number(b)
            and -BIAS_LIMIT <= b <= BIAS_LIMIT for k, b in v.items()))
        if not bias:
            return None
        self._fits_ring("logit_bias", len(bias), "max_logit_bias", "tokens")
        ids = {int(k): b for k, b in bias.items()}
        if len(ids) < len(bias):
            raise ApiError(400, f"'logit_bias' names a token id twice (got {shown(value)}): give each once",
                           param="logit_bias")
        return ids

    def check_model(self, body: dict) -> None:
        model = body_field(body, "model", (str,), "a string", self.model_name)
        if model != self.model_name:
            raise ApiError(404, f"the model {shown(model)} does not exist: this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def _stop(self, body: dict) -> tuple[str, ...]:
        rule = f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings"
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        body_field({"stop": stop}, "stop", (list,), rule, None,
               lambda v: len(v) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in v))
        return tuple(text_field(s, "stop") for s in stop or ())

    def cheap(self, body: dict, chat: bool) -> bool:
        """Whether parsing ``body`` is cheap enough for the event loop: a completion whose prompt is at most
        ``max_prompt`` token ids (alone or as a one-element batch), which needs no tokenizer, and no structured output
        (which may need compiling). Chat messages and text prompts are tokenized, which takes long for a long
        prompt."""
        prompt = None if chat else _unbatched(body.get("prompt"))
        return isinstance(prompt, list) and len(prompt) <= self.max_prompt and not structured.asks(body)

    def _completion_prompt(self, prompt) -> list[int]:
        """A string or a list of token ids, alone or as a one-element batch."""
        rule = ("a string, a list of token ids, or a one-element list of either (batches of prompts: send one "
                "request per prompt)")
        prompt = _unbatched(prompt)
        if isinstance(prompt, str):
            self._check_text_bytes(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
            ids = self.tokenizer.encode(text_field(prompt, "prompt"))
        elif isinstance(prompt, list) and are_tokens(prompt, self.tokenizer.vocab_size):
            ids = prompt
        else:
            raise ApiError(400, f"'prompt' must be {rule}, with token ids in [0, {self.tokenizer.vocab_size}) "
                                f"(got {shown(prompt)})", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty: send at least one token", param="prompt")
        return ids

    def _messages(self, messages) -> list[dict]:
        # Refused before the template renders them all (chat_messages checks each message's shape).
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise ApiError(400, f"'messages' has {len(messages)} messages, but each message takes at least "
                                f"{self.tokenizer.message_tokens} of the {self.max_prompt} prompt tokens this server "
                                f"accepts (at most {self.max_messages} messages fit): send fewer", param="messages",
                           code="context_length_exceeded")
        parsed = chat_messages(messages)
        self._check_text_bytes(sum(len(m["content"].encode()) for m in parsed), "messages")
        return parsed

    def _check_text_bytes(self, n: int, param: str) -> None:
        if n > self.max_text_bytes:
            raise ApiError(400, f"the prompt text is {n} bytes, which cannot fit in the {self.max_prompt} tokens this "
                                f"server accepts (at most {self.max_text_bytes} bytes could): shorten it", param=param,
                           code="context_length_exceeded")


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], body: dict, tools: list[dict] | None) -> list[int]:
    """The token ids the model is fed for chat ``messages`` (``chat_messages``) and the ``tools`` offered (None:
    none): the chat template rendered, with the assistant's generation prompt unless the body's
    ``add_generation_prompt`` (vLLM's) is false."""
    add_generation_prompt = body_field(body, "add_generation_prompt", (bool,), "a boolean", True)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_penalty_range(value) -> bool:
    return -PENALTY_LIMIT <= value <= PENALTY_LIMIT


def are_tokens(values: list, vocab_size: int) -> bool:
    """Whether every element of ``values`` is a token id: an int (a bool is not one) in [0, vocab_size). In C loops
    (``map``, ``set``, ``min``, ``max``): every prompt of ids is checked on the event loop, and a Python loop took
    39 us for 216 ids against 13 us."""
    return not values or (set(map(type, values)) == {int} and 0 <= min(values) and max(values) < vocab_size)
