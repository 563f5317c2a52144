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


LAUNCH_MODES = ("fire_and_forget", "tail")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and knobs of the GPU-resident scheduler (names follow vLLM where they mean the same).

    ``buckets`` are the token counts for which a step graph is captured; a step of ``n`` tokens runs the smallest
    bucket ``>= n``, so the largest bucket caps ``max_num_batched_tokens``. ``num_pages`` KV pages of ``page_size``
    tokens are shared by all sequences; one sequence may use at most ``max_model_len`` positions. ``block_threads`` is
    the scheduler kernel's block size (the simulator runs far fewer threads; results do not depend on it).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    num_pages: int = 4096
    max_model_len: int = 4096
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    eos_token_ids: tuple[int, ...] = ()
    watermark_pages: int = 0
    block_threads: int = 256
    idle_sleep_ns: int = 20_000
    launch_mode: str = "fire_and_forget"

    MAX_SEQS = 512          # the scheduler's shared-memory arrays are sized for this many running sequences
    MAX_EOS = 8

    def __post_init__(self):
        owner = "SchedulerConfig"
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages", "max_model_len",
                     "block_threads"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, owner, name, "a positive int", value)
        _check(self.max_num_seqs <= self.MAX_SEQS, owner, "max_num_seqs", f"<= {self.MAX_SEQS}", self.max_num_seqs)
        _check(self.block_threads <= 1024, owner, "block_threads", "<= 1024", self.block_threads)
        b = self.buckets
        _check(isinstance(b, tuple) and len(b) > 0 and all(_is_int(x) and x >= 1 for x in b)
               and list(b) == sorted(set(b)), owner, "buckets", "a non-empty strictly increasing tuple of ints >= 1", b)
        _check(self.max_num_batched_tokens <= b[-1], owner, "max_num_batched_tokens",
               f"<= the largest bucket {b[-1]}", self.max_num_batched_tokens)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, owner, "max_num_batched_tokens",
               f">= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step",
               self.max_num_batched_tokens)
        eos = self.eos_token_ids
        _check(isinstance(eos, tuple) and len(eos) <= self.MAX_EOS and all(_is_int(t) and t >= 0 for t in eos),
               owner, "eos_token_ids", f"a tuple of at most {self.MAX_EOS} token ids", eos)
        _check(_is_int(self.watermark_pages) and 0 <= self.watermark_pages < self.num_pages, owner,
               "watermark_pages", "an int in [0, num_pages)", self.watermark_pages)
        _check(self.max_pages_per_seq <= self.num_pages - self.watermark_pages, owner, "num_pages",
               f">= watermark_pages + {self.max_pages_per_seq} (one max_model_len sequence must fit)", self.num_pages)
        _check(_is_int(self.idle_sleep_ns) and 0 <= self.idle_sleep_ns <= 1_000_000, owner, "idle_sleep_ns",
               "an int in [0, 1e6]", self.idle_sleep_ns)
        _check(self.launch_mode in LAUNCH_MODES, owner, "launch_mode", f"one of {LAUNCH_MODES}", self.launch_mode)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine serves and with how much memory (names follow vLLM's engine arguments where they mean the same).

    ``model`` is an HF-layout directory; ``None`` serves the embedded SmolLM2-135M-Instruct. ``load_format="dummy"``
    gives the model random weights instead of its checkpoint's (only ``config.json`` is read: benchmarks and shape
    tests of large models). ``device="auto"`` takes
    the GPU when torch sees one, else the CPU. ``dtype=None`` is the checkpoint's dtype on a GPU and float32 on the CPU.

    The KV pool has ``num_pages`` pages of ``page_size`` tokens when given; otherwise, on a GPU, as many as fit in
    ``gpu_memory_utilization`` of the GPU's memory once weights, step buffers and activations are placed, and on the
    CPU ``cpu_kv_cache_gib`` GiB. ``max_model_len`` (prompt + output positions of one sequence) defaults to the model's
    context or ``max_prompt_tokens + max_output_tokens``, whichever is smaller; the pool must hold at least one
    sequence that long.

    The ring has ``n_slots`` request slots of ``max_prompt_tokens`` prompt and ``max_output_tokens`` output tokens.
    ``ring_name=None`` keeps it in this process (``Engine.generate`` drives it); a name puts it in POSIX shared memory
    (``/dev/shm/<ring_name>``) for an agent in another process. ``sim_threads`` is the simulated scheduler block size
    in CPU mode (each is a Python thread: keep it small).
    """

    model: str | None = None
    load_format: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    n_slots: int = 1024
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 2048
    max_stop_ids: int = 8
    logprobs: bool = True
    ring_name: str | None = None
    launch_mode: str = "fire_and_forget"
    sim_threads: int = 4

    def __post_init__(self):
        owner = "EngineConfig"
        _check(self.model is None or (isinstance(self.model, str) and self.model != ""), owner, "model",
               "None (the embedded default model) or a model directory", self.model)
        _check(self.load_format in LOAD_FORMATS, owner, "load_format", f"one of {LOAD_FORMATS}", self.load_format)
        _check(self.device in DEVICES, owner, "device", f"one of {DEVICES}", self.device)
        _check(self.dtype in (None, "float32", "float16", "bfloat16"), owner, "dtype",
               "None, 'float32', 'float16' or 'bfloat16'", self.dtype)
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "n_slots", "max_prompt_tokens",
                     "max_output_tokens", "sim_threads"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, owner, name, "a positive int", value)
        for name in ("max_model_len", "num_pages"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 1), owner, name, "None or a positive int", value)
        _check(_is_int(self.max_stop_ids) and 0 <= self.max_stop_ids <= 64, owner, "max_stop_ids",
               "an int in [0, 64]", self.max_stop_ids)
        u = self.gpu_memory_utilization
        _check(isinstance(u, float) and 0.0 < u <= 1.0, owner, "gpu_memory_utilization", "a float in (0, 1]", u)
        g = self.cpu_kv_cache_gib
        _check(isinstance(g, (int, float)) and not isinstance(g, bool) and g > 0, owner, "cpu_kv_cache_gib",
               "a number > 0", g)
        _check(isinstance(self.logprobs, bool), owner, "logprobs", "a bool", self.logprobs)
        _check(self.ring_name is None or (isinstance(self.ring_name, str) and self.ring_name != ""
                                          and "/" not in self.ring_name), owner, "ring_name",
               "None (an in-process ring) or a shared-memory name without '/'", self.ring_name)
        _check(self.launch_mode in LAUNCH_MODES, owner, "launch_mode", f"one of {LAUNCH_MODES}", self.launch_mode)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, owner, "max_num_batched_tokens",
               f">= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step",
               self.max_num_batched_tokens)
        _check(self.max_num_seqs <= SchedulerConfig.MAX_SEQS, owner, "max_num_seqs", f"<= {SchedulerConfig.MAX_SEQS}",
               self.max_num_seqs)

    def geometry(self):
        """The ``RingGeometry`` of the engine's ring."""
        from blink.device.ring import RingGeometry

        return RingGeometry(self.n_slots, self.max_prompt_tokens, self.max_output_tokens, self.max_stop_ids,
                            self.logprobs)

    def buckets(self) -> tuple[int, ...]:
        """Token counts a step graph is captured for: powers of two up to ``max_num_batched_tokens``, and it."""
        n = self.max_num_batched_tokens
        return (*(1 << k for k in range(n.bit_length()) if 1 << k < n), n)
