"""What one request carries into the ring: ``SamplingParams`` and the encoding of a request's header.

``SamplingParams`` is validated at construction (each error names the field and the accepted range); ``encode_header``
then checks every number against the type of the header field that stores it, so nothing that would overflow,
wrap or round to something else is ever written (a value checked only against the Python type once became a
different number in a 32-bit field). Limits that depend on one ring's geometry (prompt length, ``max_tokens``, the
number of stop ids) are checked by the agent against that ring.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from blink.ring.errors import RequestError
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS, MAX_TOP_LOGPROBS
from blink.ring.grammar import Grammar
from blink.ring.layout import FLAG_GRAMMAR, FLAG_IGNORE_EOS, FLAG_LOGPROBS, HEADER_DTYPE, PAIR_DTYPE, TOKEN_DTYPE

U64_MAX = (1 << 64) - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Below this a temperature is greedy (vLLM's rule too): dividing logits by a denormal float32 overflows them.
GREEDY_BELOW = 1e-5
PENALTY_LIMIT = 2      # presence and frequency penalties lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (OpenAI's)
BIAS_LIMIT = 100       # a logit bias lies in [-BIAS_LIMIT, BIAS_LIMIT] (OpenAI's)


def shown(value) -> str:
    """``repr(value)`` for an error message, cut to 80 characters (a JSON integer may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(ok: bool, field: str, rule: str, value) -> None:
    if not ok:
        raise RequestError(field, f"SamplingParams.{field} must be {rule} (got {shown(value)})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, as in vLLM / the OpenAI API.

    ``temperature == 0`` is greedy (and so is any temperature below ``GREEDY_BELOW``, which is stored as 0).
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed=None`` lets the agent pick a random seed; a fixed
    seed gives the same tokens whatever else is batched with the request. ``stop_token_ids`` end the request on the
    GPU (the stop token is part of the output); ``stop`` strings end it on the agent's side, matched on the decoded
    text (the stop string is not part of the output). ``ignore_eos`` keeps generating past the model's
    end-of-sequence tokens. ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2], 0 disables) lower the logit of
    every token already generated, once / per occurrence; ``repetition_penalty`` (> 0, 1 disables) divides a positive
    logit (multiplies a negative one) of every token in the prompt or the output: vLLM's penalties, applied on the
    device before temperature and the filters. ``logit_bias`` (token id → a number in [-100, 100]) is added to those
    tokens' logits before the penalties (vLLM's order). ``min_p`` (in [0, 1], 0 disables) keeps the tokens whose
    probability, after temperature, is at least ``min_p`` times the most likely token's (vLLM's rule), before top-k
    and top-p.
    ``top_logprobs`` (up to ``MAX_TOP_LOGPROBS``; needs ``logprobs``) reports that many most likely tokens with their
    logprobs at each position, of the same distribution as the sampled token's logprob (after the penalties and
    ``logit_bias``, before temperature and the filters).
    ``grammar`` (a compiled structured output, ``blink.ring.grammar``; ``blink.nic.grammars`` compiles one) restricts
    every token to those its automaton allows where the output has got to, after ``logit_bias`` and the penalties
    (so the logprobs are of the restricted distribution), and allows the end-of-sequence tokens only where the output
    is complete; it cannot be combined with ``ignore_eos``.
    ``num_speculative_tokens`` caps the drafts the engine verifies for this request per step, where the engine
    speculates (``SpeculativeConfig``): None leaves the engine's number, 0 opts the request out. The tokens are the
    same either way; only how many a step makes changes.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    top_logprobs: int = 0
    grammar: Grammar | None = None
    num_speculative_tokens: int | None = None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def __post_init__(self):
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens < 2**31, "max_tokens", "an int in [1, 2**31)",
               self.max_tokens)
        t = self.temperature
        _check(_is_number(t) and 0.0 <= t <= FLOAT32_MAX, "temperature",
               f"a finite number in [0, {FLOAT32_MAX:.4g}] (float32)", t)
        if t < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        p = self.top_p
        _check(_is_number(p) and 0.0 < p <= 1.0 and np.float32(p) > 0, "top_p", "in (0, 1]", p)
        _check(_is_int(self.top_k) and 0 <= self.top_k < 2**31, "top_k", "an int in [0, 2**31) (0 disables top-k)",
               self.top_k)
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= U64_MAX), "seed",
               "None or an int in [0, 2**64)", self.seed)
        stops = self.stop_token_ids
        _check(isinstance(stops, (tuple, list)) and all(_is_int(s) and 0 <= s < 2**31 for s in stops),
               "stop_token_ids", "a sequence of token ids in [0, 2**31)", stops)
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(isinstance(stop, (tuple, list)) and all(isinstance(s, str) and s for s in stop), "stop",
               "a string or a sequence of non-empty strings", self.stop)
        object.__setattr__(self, "stop", tuple(stop))
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _check(isinstance(self.logprobs, bool), "logprobs", "a bool", self.logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT, name,
                   f"a number in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}] (0 disables it)", value)
        r = self.repetition_penalty
        _check(_is_number(r) and 0.0 < r <= FLOAT32_MAX and np.float32(r) > 0, "repetition_penalty",
               f"a number in (0, {FLOAT32_MAX:.4g}] (float32; 1 disables it)", r)
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "a number in [0, 1] (0 disables it)",
               self.min_p)
        bias = self.logit_bias
        _check(bias is None or (isinstance(bias, dict) and all(_is_int(t) and 0 <= t < 2**31 and _is_number(b)
                                                               and -BIAS_LIMIT <= b <= BIAS_LIMIT
                                                               for t, b in bias.items())),
               "logit_bias", f"None or a dict of token ids in [0, 2**31) to numbers in [-{BIAS_LIMIT}, {BIAS_LIMIT}]",
               bias)
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"an int in [0, {MAX_TOP_LOGPROBS}]", self.top_logprobs)
        _check(self.top_logprobs == 0 or self.logprobs, "top_logprobs", "0 unless logprobs is True",
               self.top_logprobs)
        _check(self.grammar is None or isinstance(self.grammar, Grammar), "grammar",
               "None or a compiled Grammar (blink.nic.grammars.GrammarCompiler.compile)", self.grammar)
        _check(self.num_speculative_tokens is None or (_is_int(self.num_speculative_tokens)
                                                        and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS),
               "num_speculative_tokens", f"None or an int in [0, {MAX_SPECULATIVE_TOKENS}] (0: no drafts)",
               self.num_speculative_tokens)
        _check(self.grammar is None or not self.ignore_eos, "grammar",
               "None when ignore_eos is True (a grammar ends its output with an end-of-sequence token)", self.grammar)


_PARAMS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


def encode_header(*, request_id: int, arrival_ns: int, seed: int, prompt_len: int, params: SamplingParams,
                  priority: int, prefix_state: int = 0, grammar: int = 0) -> bytes:
    """One request's header (``HEADER_DTYPE``), every value checked against its field's type first (``RequestError``
    naming it); the caller has checked the geometry's limits.

    A field named as a ``SamplingParams`` field takes ``params``' value; ``seed`` is the request's or the one the
    agent picked. ``prefix_state`` is the prompt's prefix-key chain state (``blink.ring.hashing``); ``grammar`` the
    first word of ``params.grammar``'s placement in the grammars region (``blink.ring.grammar``).
    """
    values = {name: getattr(params, name) for name in HEADER_DTYPE.names if name in _PARAMS}
    flags = ((FLAG_IGNORE_EOS if params.ignore_eos else 0) | (FLAG_LOGPROBS if params.logprobs else 0)
             | (FLAG_GRAMMAR if params.grammar is not None else 0))
    if params.num_speculative_tokens is None:       # the engine's number: the most any engine verifies
        values["num_speculative_tokens"] = MAX_SPECULATIVE_TOKENS
    values.update(request_id=request_id, arrival_ns=arrival_ns, seed=seed, prompt_len=prompt_len, priority=priority,
                  request_flags=flags, n_stop=len(params.stop_token_ids), prefix_state=prefix_state,
                  n_logit_bias=len(params.logit_bias or ()), grammar=grammar)
    # Zeroed (its padding too: these bytes go into shared memory), then every field from one tuple: a field-by-field
    # fill cost ~1 us a field.
    header = np.zeros(1, HEADER_DTYPE)
    header[0] = tuple(_fits(HEADER_DTYPE.fields[name][0], name, values[name]) for name in HEADER_DTYPE.names)
    return header.tobytes()


def encode_stop_token_ids(params: SamplingParams) -> bytes:
    """The request's ``stop_token_ids`` as the ring's row of them stores it (the agent has checked that they fit
    the row); empty without any."""
    return np.array([_fits(TOKEN_DTYPE, "stop_token_ids", t) for t in params.stop_token_ids],
                    TOKEN_DTYPE).tobytes()


def encode_logit_bias(params: SamplingParams) -> bytes:
    """The request's ``logit_bias`` as the ring's row of (token, bias) pairs stores it (the agent has checked that
    they fit the row); empty without one."""
    pairs = np.zeros(len(params.logit_bias or ()), PAIR_DTYPE)
    if params.logit_bias:
        pairs["token"] = list(params.logit_bias)
        pairs["value"] = list(params.logit_bias.values())
    return pairs.tobytes()


@functools.cache
def _bounds(dtype: np.dtype) -> tuple:
    """What a header field of type ``dtype`` stores: ``(min, max)`` of an int type; of a float type, the largest
    finite magnitude, negated and as is (every number between them converts to a finite value)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)
    largest = float(np.finfo(dtype).max)
    return -largest, largest


def _fits(dtype: np.dtype, name: str, value):
    """``value`` if the header field of type ``dtype`` stores it exactly (floats: finite in that precision)."""
    low, high = _bounds(dtype)
    if dtype.kind in "iu":
        if not _is_int(value) or not low <= value <= high:
            raise RequestError(name, f"request field '{name}' must be an int in [{low}, {high}] to fit the "
                                     f"ring header's {dtype.name} (got {shown(value)})")
        return value
    if not _is_number(value):
        raise RequestError(name, f"request field '{name}' must be a number (got {shown(value)})")
    if low <= value <= high:
        return value
    # Beyond the largest finite value (or NaN, infinite): it may still round down to it; convert to find out.
    with np.errstate(over="ignore"):
        stored = float(np.asarray(value, dtype))
    if not math.isfinite(stored):
        raise RequestError(name, f"request field '{name}' must be a finite number that fits the ring header's "
                                 f"{dtype.name} (got {shown(value)})")
    return value
