"""``SchedulerConfig``: the limits and knobs of the GPU-resident scheduler, validated at construction.

Names follow vLLM where they mean the same. Three fields may be left to the engine, which knows them only once the
model is loaded: ``num_pages`` (None: as many as the memory budget holds), ``max_model_len`` (None: the model's
context, capped by the ring) and ``eos_token_ids`` (the tokenizer's are added). ``resolve`` fills them in; the device
code only ever sees a resolved configuration (``resolved`` is True).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from blink.ring.geometry import MAX_SPECULATIVE_TOKENS

LAUNCH_MODES = ("fire_and_forget", "tail")
MAX_SEQS = 512          # the scheduler's shared-memory arrays are sized for this many running sequences
MAX_EOS = 8             # end-of-sequence ids the device checks per token
MAX_BUCKETS = 32        # step graphs the launch table holds
MAX_BLOCK_THREADS = 1024
MAX_IDLE_SLEEP_NS = 1_000_000
SPECULATIVE_METHODS = ("ngram",)
# The compute capability the scheduler image is built for, its only one (a cubin loads on its own major version):
# the H100, H200 and GH200. docs/gpu.md says what building for another would take.
IMAGE_CC = (9, 0)
IMAGE_ARCH = f"sm_{IMAGE_CC[0]}{IMAGE_CC[1]}"


def check(ok: bool, owner: str, field: str, rule: str, value) -> None:
    """``ValueError`` naming ``owner.field``, the rule it breaks and the value, unless ``ok``."""
    if not ok:
        raise ValueError(f"{owner}.{field} must be {rule} (got {value!r})")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def graded_buckets(max_num_batched_tokens: int, per_doubling: int = 4) -> tuple[int, ...]:
    """1, 2, 4, 8, then sizes ``max(8, 2**k / per_doubling)`` apart in ``[2**k, 2**(k+1))``, below
    ``max_num_batched_tokens``, and it.

    A step pads to the smallest bucket that holds it, so a step of more than 8 tokens pads by fewer than 8 rows or
    ``1/per_doubling`` of its size, where powers of two pad by up to 100 %. ``per_doubling`` halves until the sizes fit
    in ``MAX_BUCKETS`` (2048 tokens: 31 sizes; 4096: 21).
    """
    n, sizes, size = max_num_batched_tokens, [1, 2, 4], 8
    while size < n:
        sizes.append(size)
        size += max(8, (1 << (size.bit_length() - 1)) // per_doubling)
    sizes = [s for s in sizes if s < n] + [n]
    if len(sizes) > MAX_BUCKETS and per_doubling > 1:
        return graded_buckets(n, per_doubling // 2)
    return tuple(sizes)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's ``--speculative-config`` names. ``method`` "ngram" (prompt lookup): in every
    step, each decoding sequence that can proposes up to ``num_speculative_tokens`` drafts, the
    tokens that followed the latest earlier occurrence of its last ``n`` tokens in its own prompt and output (``n``
    from ``prompt_lookup_max`` down to ``prompt_lookup_min``); the step scores them all and the sequence keeps the
    drafts its own sampled tokens confirm, plus one token of its own (docs/scheduler.md, "Speculative decoding").
    ``disable_by_batch_size`` (None: never) plans no drafts in a step where more sequences than that run: a large
    batch's verification rows make its projections compute-bound, so each draft costs nearly a token's step share."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        owner = "SpeculativeConfig"
        check(self.method in SPECULATIVE_METHODS, owner, "method", f"one of {SPECULATIVE_METHODS}", self.method)
        check(is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              owner, "num_speculative_tokens", f"an int in [1, {MAX_SPECULATIVE_TOKENS}]",
              self.num_speculative_tokens)
        check(is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, owner, "prompt_lookup_min",
              "an int >= 1", self.prompt_lookup_min)
        check(is_int(self.prompt_lookup_max) and self.prompt_lookup_min <= self.prompt_lookup_max <= 64, owner,
              "prompt_lookup_max", f"an int in [prompt_lookup_min ({self.prompt_lookup_min}), 64]",
              self.prompt_lookup_max)
        check(self.disable_by_batch_size is None or (is_int(self.disable_by_batch_size)
                                                     and self.disable_by_batch_size >= 2),
              owner, "disable_by_batch_size", "None or an int >= 2 (as vLLM's)", self.disable_by_batch_size)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'``; ``ValueError`` naming a
        field this server does not know."""
        import json

        try:
            given = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config must be a JSON object ({e}): e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(given, dict):
            raise ValueError(f"--speculative-config must be a JSON object (got {given!r})")
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"--speculative-config: unknown field(s) {sorted(unknown)} (this server knows "
                             f"{[f.name for f in dataclasses.fields(cls)]})")
        return cls(**given)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and knobs of the GPU-resident scheduler.

    ``buckets`` are the token counts for which a step graph is captured (default: ``graded_buckets`` of
    ``max_num_batched_tokens``); a step of ``n`` tokens runs the smallest bucket ``>= n``, so the largest
    bucket caps ``max_num_batched_tokens``. ``num_pages`` KV pages of ``page_size`` tokens are shared by all sequences;
    one sequence may use at most ``max_model_len`` positions, and admission keeps ``watermark_pages`` free.
    ``block_threads`` is the scheduler kernel's block size (the simulator runs far fewer threads; results do not
    depend on it); on a GPU the block must fit the kernel's registers (65,536 for a block; the kernel uses up to 255
    per thread), which ``GpuScheduler`` checks at start, naming the largest block that fits. An idle loop iterates
    every ``idle_sleep_ns`` (the resident loop sooner when a doorbell moves: it watches them meanwhile).
    ``launch_mode`` is how the loop launches step graphs (``fire_and_forget``: a resident scheduler; ``tail``: one
    iteration per launch).
    ``enable_prefix_caching`` keeps full KV pages findable by the key of their prefix, so a request that shares a
    prompt prefix with an earlier one skips its prefill (docs/scheduler.md, "Prefix caching"; on by default, as in
    vLLM); its ring must carry the prompts' page keys (``RingGeometry.prefix_page_size == page_size``).
    ``speculative`` (a ``SpeculativeConfig``; None: off) lets decoding sequences propose and verify drafts.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    num_pages: int | None = None
    max_model_len: int | None = None
    buckets: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    watermark_pages: int = 0
    block_threads: int = 256
    idle_sleep_ns: int = 20_000
    launch_mode: str = "fire_and_forget"
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        owner = "SchedulerConfig"
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "block_threads"):
            value = getattr(self, name)     # the device state holds each as an int32
            check(is_int(value) and 1 <= value < 2**31, owner, name, "an int in [1, 2**31)", value)
        for name in ("num_pages", "max_model_len"):
            value = getattr(self, name)
            check(value is None or (is_int(value) and 1 <= value < 2**31), owner, name,
                  "None (decided at start-up) or an int in [1, 2**31)", value)
        check(self.max_num_seqs <= MAX_SEQS, owner, "max_num_seqs", f"<= {MAX_SEQS}", self.max_num_seqs)
        check(self.block_threads <= MAX_BLOCK_THREADS, owner, "block_threads", f"<= {MAX_BLOCK_THREADS}",
              self.block_threads)
        if self.buckets is None:
            object.__setattr__(self, "buckets", graded_buckets(self.max_num_batched_tokens))
        b = self.buckets
        check(isinstance(b, tuple) and 0 < len(b) <= MAX_BUCKETS and all(is_int(x) and 1 <= x < 2**31 for x in b)
              and list(b) == sorted(set(b)), owner, "buckets",
              f"a non-empty strictly increasing tuple of at most {MAX_BUCKETS} ints in [1, 2**31)", b)
        check(self.max_num_batched_tokens <= b[-1], owner, "max_num_batched_tokens",
              f"<= the largest bucket {b[-1]}", self.max_num_batched_tokens)
        check(self.max_num_batched_tokens >= self.max_num_seqs, owner, "max_num_batched_tokens",
              f">= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step",
              self.max_num_batched_tokens)
        eos = self.eos_token_ids
        check(isinstance(eos, tuple) and len(eos) <= MAX_EOS and all(is_int(t) and 0 <= t < 2**31 for t in eos),
              owner, "eos_token_ids", f"a tuple of at most {MAX_EOS} token ids in [0, 2**31)", eos)
        check(is_int(self.watermark_pages) and self.watermark_pages >= 0, owner, "watermark_pages", "an int >= 0",
              self.watermark_pages)
        if self.num_pages is not None:
            check(self.watermark_pages < self.num_pages, owner, "watermark_pages", "an int in [0, num_pages)",
                  self.watermark_pages)
        if self.resolved:
            check(self.max_pages_per_seq <= self.num_pages - self.watermark_pages, owner, "num_pages",
                  f">= watermark_pages + {self.max_pages_per_seq} (one max_model_len sequence must fit)",
                  self.num_pages)
        check(is_int(self.idle_sleep_ns) and 0 <= self.idle_sleep_ns <= MAX_IDLE_SLEEP_NS, owner, "idle_sleep_ns",
              f"an int in [0, {MAX_IDLE_SLEEP_NS}]", self.idle_sleep_ns)
        check(self.launch_mode in LAUNCH_MODES, owner, "launch_mode", f"one of {LAUNCH_MODES}", self.launch_mode)
        check(isinstance(self.enable_prefix_caching, bool), owner, "enable_prefix_caching", "a bool",
              self.enable_prefix_caching)
        check(self.speculative is None or isinstance(self.speculative, SpeculativeConfig), owner, "speculative",
              "None or a SpeculativeConfig", self.speculative)

    @property
    def resolved(self) -> bool:
        """Every size the device code needs is known."""
        return self.num_pages is not None and self.max_model_len is not None

    @property
    def max_pages_per_seq(self) -> int:
        if self.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len is not resolved yet (None): resolve() it first")
        return -(-self.max_model_len // self.page_size)

    def resolve(self, *, num_pages: int, max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> SchedulerConfig:
        """This configuration with the sizes decided at start-up filled in where they were left to the engine."""
        eos = tuple(sorted(set(self.eos_token_ids) | set(eos_token_ids)))
        return dataclasses.replace(self, num_pages=self.num_pages or num_pages,
                                   max_model_len=self.max_model_len or max_model_len, eos_token_ids=eos)
