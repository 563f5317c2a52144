"""Frozen configuration dataclasses, validated at construction. Each error names the field and the accepted range."""
from __future__ import annotations

from dataclasses import dataclass

U64_MAX = (1 << 64) - 1


def _check(ok: bool, owner: str, field: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{owner}.{field} must be {rule} (got {value!r})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, as in vLLM / the OpenAI API.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed=None`` lets the
    agent pick a random seed; a fixed seed gives the same tokens whatever else is batched with the request.
    ``stop_token_ids`` end the request (the stop token is part of the output); ``ignore_eos`` keeps generating past the
    model's end-of-sequence tokens. Limits that depend on the ring (prompt length, ``max_tokens``, number of stop ids)
    are checked when the request is submitted.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self):
        owner = "SamplingParams"
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, owner, "max_tokens", "an int >= 1", self.max_tokens)
        t = self.temperature
        _check(isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 <= t < float("inf"), owner,
               "temperature", "a finite number >= 0", t)
        p = self.top_p
        _check(isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 < p <= 1.0, owner, "top_p",
               "in (0, 1]", p)
        _check(_is_int(self.top_k) and self.top_k >= 0, owner, "top_k", "an int >= 0 (0 disables top-k)", self.top_k)
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= U64_MAX), owner, "seed",
               "None or an int in [0, 2**64)", self.seed)
        stops = self.stop_token_ids
        _check(isinstance(stops, (tuple, list)) and all(_is_int(s) and 0 <= s < 2**31 for s in stops), owner,
               "stop_token_ids", "a sequence of token ids in [0, 2**31)", stops)
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        _check(isinstance(self.ignore_eos, bool), owner, "ignore_eos", "a bool", self.ignore_eos)
        _check(isinstance(self.logprobs, bool), owner, "logprobs", "a bool", self.logprobs)
