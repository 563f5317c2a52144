"""``RingGeometry``: the sizes a ring is built from. Both sides build their ``RingLayout`` from equal geometries."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RingGeometry:
    """Sizes of the ring: request slots, and per slot the longest prompt, output and stop-id list it holds; and the
    engine's limit on one sequence, ``max_model_len`` (prompt + output positions; None: the slot's prompt and output
    capacity together), which the agent enforces before a request reaches the ring.

    ``LIMITS`` bound each size by what its control-block word and the regions' byte offsets can hold; ``check``
    applies them to one value, for configurations that carry a ring size of their own (``EngineConfig``).
    """

    n_slots: int = 4096
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 2048
    max_stop_ids: int = 8
    logprobs: bool = True
    max_model_len: int | None = None

    LIMITS = {"n_slots": (1, 1 << 20), "max_prompt_tokens": (1, 1 << 24), "max_output_tokens": (1, 1 << 24),
              "max_stop_ids": (0, 64), "max_model_len": (2, (1 << 31) - 1)}

    def __post_init__(self):
        if self.max_model_len is None and isinstance(self.max_prompt_tokens, int) \
                and isinstance(self.max_output_tokens, int):
            object.__setattr__(self, "max_model_len", self.max_prompt_tokens + self.max_output_tokens)
        for name in self.LIMITS:
            self.check(name, getattr(self, name), "RingGeometry")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"RingGeometry.logprobs must be a bool (got {self.logprobs!r})")

    @classmethod
    def check(cls, name: str, value, owner: str) -> None:
        """``ValueError`` naming ``owner.name`` unless ``value`` is an int within the ring's limit for ``name``."""
        lo, hi = cls.LIMITS[name]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{owner}.{name} must be an int in [{lo}, {hi}] (got {value!r})")
