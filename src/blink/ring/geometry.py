"""``RingGeometry``: the sizes a ring is built from. Both sides build their ``RingLayout`` from equal geometries."""
from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20   # the most top logprobs per token a request may ask for (OpenAI's limit)
MAX_SPECULATIVE_TOKENS = 16     # drafts per sequence and step: a request's and a server's most
MAX_GRAMMAR_BYTES = 1 << 30     # the grammars region's largest size: its word offsets stay far inside an int32


@dataclass(frozen=True)
class RingGeometry:
    """Sizes of the ring: request slots, and per slot the longest prompt, output and stop-id list it holds; and the
    engine's limit on one sequence, ``max_model_len`` (prompt + output positions; None: the slot's prompt and output
    capacity together), which the agent enforces before a request reaches the ring. ``prefix_page_size``: the KV
    page size whose prompt-page keys (``blink.ring.hashing``) the agent writes with each request, for the GPU's
    prefix cache; 0: the ring carries no keys. ``max_logit_bias``: the (token, bias) pairs one request's
    ``logit_bias`` may hold (0: none); ``max_top_logprobs``: the most likely tokens (with their logprobs) the GPU
    reports per output position when a request asks for ``top_logprobs`` (0: the ring has no room for them; it
    costs ``8 × n_slots × max_output_tokens × max_top_logprobs`` bytes). ``max_grammar_bytes``: the size of the
    ``grammars`` region, where the agent places the compiled grammars of structured outputs (``blink.ring.grammar``;
    0: no region, and requests with a grammar are refused); their token masks cover ``vocab_size`` tokens, the
    model's vocabulary (the width of its logits; 0 only without the region).

    ``LIMITS`` bound each size by what its control-block word and the regions' byte offsets can hold; ``check``
    applies them to one value, for configurations that carry a ring size of their own (``EngineConfig``).
    """

    n_slots: int = 4096
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 2048
    max_stop_ids: int = 8
    logprobs: bool = True
    max_model_len: int | None = None
    prefix_page_size: int = 0
    max_logit_bias: int = 300
    max_top_logprobs: int = 0
    max_grammar_bytes: int = 0
    vocab_size: int = 0

    LIMITS = {"n_slots": (1, 1 << 20), "max_prompt_tokens": (1, 1 << 24), "max_output_tokens": (1, 1 << 24),
              "max_stop_ids": (0, 64), "max_model_len": (2, (1 << 31) - 1), "prefix_page_size": (0, 1 << 16),
              "max_logit_bias": (0, 1 << 16), "max_top_logprobs": (0, MAX_TOP_LOGPROBS),
              "max_grammar_bytes": (0, MAX_GRAMMAR_BYTES), "vocab_size": (0, 1 << 24)}

    def __post_init__(self):
        if self.max_model_len is None and isinstance(self.max_prompt_tokens, int) \
                and isinstance(self.max_output_tokens, int):
            object.__setattr__(self, "max_model_len", self.max_prompt_tokens + self.max_output_tokens)
        for name in self.LIMITS:
            self.check(name, getattr(self, name), "RingGeometry")
        if self.max_grammar_bytes and not self.vocab_size:
            raise ValueError("RingGeometry.vocab_size must be the model's vocabulary size (> 0) when "
                             f"max_grammar_bytes is {self.max_grammar_bytes}: the grammars' token masks cover it")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"RingGeometry.logprobs must be a bool (got {self.logprobs!r})")

    @property
    def prefix_key_pages(self) -> int:
        """Keys per slot in the ``prefix_keys`` region: the full pages of the longest prompt (0 without keys)."""
        return self.max_prompt_tokens // self.prefix_page_size if self.prefix_page_size else 0

    @classmethod
    def check(cls, name: str, value, owner: str) -> None:
        """``ValueError`` naming ``owner.name`` unless ``value`` is an int within the ring's limit for ``name``."""
        lo, hi = cls.LIMITS[name]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{owner}.{name} must be an int in [{lo}, {hi}] (got {value!r})")
