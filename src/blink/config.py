"""``EngineConfig``: what the engine serves, with how much memory, over which ring, scheduled how.

Frozen and validated at construction; each error names the field and the accepted range. The scheduler's own limits
are a ``SchedulerConfig`` held whole (``EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64))``), the admission
policy a device function or its import path, so a Python-authored policy reaches a served model.
"""
from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field

from blink.device.config import MAX_BLOCK_THREADS, SchedulerConfig, SpeculativeConfig, check, is_int
from blink.ring.geometry import RingGeometry
from blink.ring.request import SamplingParams
from blink.ring.split import REQUEST_SIDES
from blink.ring.transport import SHM_NAME_RULE, is_shm_name

DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8",)  # blink.models.quantization.QUANTIZATIONS (the engine's config imports no torch)
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 (blink.models.memory.kv_cache_dtype)
# A model's context beyond this must be asked for (``max_model_len``): every ring slot holds that many prompt and
# output tokens, in shared memory.
DEFAULT_MAX_MODEL_LEN = 4096
MAX_TENSOR_PARALLEL = 64      # processes one engine may split a model over

__all__ = ["DEFAULT_MAX_MODEL_LEN", "DEVICES", "DTYPES", "EngineConfig", "KV_CACHE_DTYPES", "LOAD_FORMATS",
           "QUANTIZATIONS", "SamplingParams", "SchedulerConfig", "SpeculativeConfig", "load_policy"]


@dataclass(frozen=True)
class EngineConfig:
    """What the engine serves and with how much memory (names follow vLLM's engine arguments where they mean the same).

    ``model`` is an HF-layout directory; ``None`` serves the embedded SmolLM2-135M-Instruct. ``load_format="dummy"``
    gives the model random weights instead of its checkpoint's (only ``config.json`` is read: benchmarks and shape
    tests of large models). ``device="auto"`` takes the GPU when torch sees one, else the CPU. ``dtype=None`` is the
    checkpoint's dtype on a GPU and float32 on the CPU. ``quantization="fp8"`` quantizes the checkpoint's projections
    to FP8 e4m3 with per-channel scales at load (vLLM's ``--quantization fp8``); an FP8 checkpoint (its config's
    ``quantization_config``) is served in FP8 without it; under tensor parallelism each rank quantizes its shard.
    ``kv_cache_dtype="fp8"`` keeps the KV cache in e4m3 at scale 1 (vLLM's ``--kv-cache-dtype fp8`` without calibrated
    scales: values beyond ±448 saturate): half the bytes a token, so twice the pages, and half the reads of attention;
    every rank's pool so under tensor parallelism.

    ``scheduler`` holds the scheduler's limits. Where it leaves ``num_pages`` to the engine, the KV pool takes, on a
    GPU, what fits in ``gpu_memory_utilization`` of the GPU's memory once weights, step buffers and activations are
    placed, and on the CPU ``cpu_kv_cache_gib`` GiB; where it leaves ``max_model_len``, a sequence may use the
    model's context up to ``DEFAULT_MAX_MODEL_LEN`` positions (and up to ``max_prompt_tokens + max_output_tokens``
    when both are given). The pool must hold at least one sequence that long.
    ``policy`` orders admission: None (first come, first served), a function of the request's header fields
    (``blink.device.policy``: plain Python arithmetic, compiled for the GPU) or its import path
    ``"module:function"`` (what crosses into an engine process).

    The ring has ``n_slots`` request slots of ``max_prompt_tokens`` prompt and ``max_output_tokens`` output tokens
    (None: ``max_model_len - 1`` each), each request's ``logit_bias`` up to ``max_logit_bias`` tokens and
    ``top_logprobs`` up to ``max_top_logprobs`` per token (0: none; that area costs ``8 × n_slots ×
    max_output_tokens × max_top_logprobs`` bytes of ring), and ``max_grammar_bytes`` of ring hold the compiled grammars
    of structured outputs (``blink.ring.grammar``; 0: none, and requests with a grammar are refused).
    ``ring_name=None`` keeps it in this process; a name puts it in POSIX shared memory (``/dev/shm/<ring_name>``) for
    an agent in another process. ``sim_threads`` is the simulated scheduler block size in CPU mode (each is a Python
    thread: keep it small). ``tensor_parallel_size`` splits the model over that many processes (``blink.ranks``; CPU
    only so far).

    ``request_side="device"`` (GPU only) keeps the ring's request side (control block, status, headers, prompts) in
    GPU memory, where the scheduler's polls are HBM reads and a NIC writes it by GPUDirect RDMA; the output side
    stays in host memory. This process's agent then reaches the ring through ``EngineCore.ring_memory``, other
    processes only through the engine's listener (``blink engine --listen``; the shared-memory copy refuses them).
    """

    model: str | None = None
    load_format: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    policy: object = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    n_slots: int = 256
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_stop_ids: int = 8
    logprobs: bool = True
    max_logit_bias: int = RingGeometry.max_logit_bias
    max_top_logprobs: int = RingGeometry.max_top_logprobs
    max_grammar_bytes: int = RingGeometry.max_grammar_bytes
    ring_name: str | None = None
    sim_threads: int = 4
    tensor_parallel_size: int = 1
    request_side: str = "host"

    def __post_init__(self):
        owner = "EngineConfig"
        check(self.model is None or (isinstance(self.model, str) and self.model != ""), owner, "model",
              "None (the embedded default model) or a model directory", self.model)
        check(self.load_format in LOAD_FORMATS, owner, "load_format", f"one of {LOAD_FORMATS}", self.load_format)
        check(self.device in DEVICES, owner, "device", f"one of {DEVICES}", self.device)
        check(self.dtype is None or self.dtype in DTYPES, owner, "dtype", f"None or one of {DTYPES}", self.dtype)
        check(self.quantization is None or self.quantization in QUANTIZATIONS, owner, "quantization",
              f"None or one of {QUANTIZATIONS}", self.quantization)
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, owner, "kv_cache_dtype", f"one of {KV_CACHE_DTYPES}",
              self.kv_cache_dtype)
        check(isinstance(self.scheduler, SchedulerConfig), owner, "scheduler", "a SchedulerConfig", self.scheduler)
        check(self.policy is None or isinstance(self.policy, str) or callable(self.policy), owner, "policy",
              "None, a function or 'module:function'", self.policy)
        RingGeometry.check("n_slots", self.n_slots, owner)
        for name in ("max_stop_ids", "max_logit_bias", "max_top_logprobs", "max_grammar_bytes"):
            RingGeometry.check(name, getattr(self, name), owner)
        for name in ("max_prompt_tokens", "max_output_tokens"):
            if getattr(self, name) is not None:
                RingGeometry.check(name, getattr(self, name), owner)
        check(is_int(self.sim_threads) and 1 <= self.sim_threads <= MAX_BLOCK_THREADS, owner, "sim_threads",
              f"an int in 1..{MAX_BLOCK_THREADS} (a CUDA block's threads)", self.sim_threads)
        check(is_int(self.tensor_parallel_size) and 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL, owner,
              "tensor_parallel_size", f"an int in 1..{MAX_TENSOR_PARALLEL}", self.tensor_parallel_size)
        check(self.request_side in REQUEST_SIDES, owner, "request_side", f"one of {REQUEST_SIDES}", self.request_side)
        u = self.gpu_memory_utilization
        check(isinstance(u, float) and 0.0 < u <= 1.0, owner, "gpu_memory_utilization", "a float in (0, 1]", u)
        g = self.cpu_kv_cache_gib
        check(isinstance(g, (int, float)) and not isinstance(g, bool) and 0 < g < math.inf, owner,
              "cpu_kv_cache_gib", "a finite number > 0", g)
        check(isinstance(self.logprobs, bool), owner, "logprobs", "a bool", self.logprobs)
        check(self.ring_name is None or is_shm_name(self.ring_name), owner, "ring_name",
              f"None (an in-process ring) or a shared-memory name: {SHM_NAME_RULE}", self.ring_name)

    def max_model_len(self, context_len: int) -> int:
        """A sequence's positions for a model of ``context_len``; ``ValueError`` saying what to change."""
        length = self.scheduler.max_model_len
        if length is None:
            # No sequence outlives what a ring slot holds of it, when both limits are given.
            ring = (self.max_prompt_tokens + self.max_output_tokens
                    if self.max_prompt_tokens and self.max_output_tokens else DEFAULT_MAX_MODEL_LEN)
            length = min(context_len, DEFAULT_MAX_MODEL_LEN, ring)
        if length > context_len:
            raise ValueError(f"SchedulerConfig.max_model_len={length} is longer than the model's context "
                             f"(max_position_embeddings={context_len}): lower it")
        if length < 2:
            raise ValueError(f"SchedulerConfig.max_model_len={length} leaves no room to generate: it must be >= 2")
        return length

    def geometry(self, max_model_len: int, vocab_size: int = 0) -> RingGeometry:
        """The ring for sequences of ``max_model_len`` positions; ``ValueError`` if a prompt would leave no room.
        ``vocab_size``: the model's, where the engine serves grammars (0: the ring gets no grammars region)."""
        prompt = self.max_prompt_tokens or max_model_len - 1
        if prompt >= max_model_len:
            raise ValueError(f"EngineConfig.max_prompt_tokens={prompt} leaves no room to generate in sequences of "
                             f"max_model_len={max_model_len} tokens: lower max_prompt_tokens (or leave it out)")
        caching = self.scheduler.enable_prefix_caching
        return RingGeometry(self.n_slots, prompt, self.max_output_tokens or max_model_len - 1, self.max_stop_ids,
                            self.logprobs, max_model_len, self.scheduler.page_size if caching else 0,
                            self.max_logit_bias, self.max_top_logprobs,
                            self.max_grammar_bytes if vocab_size else 0, vocab_size if self.max_grammar_bytes else 0)

    def policy_function(self):
        """The admission policy as a numba device function (``blink.device.policy.fcfs`` when None)."""
        return load_policy(self.policy)


def load_policy(policy):
    """A policy given as None, a function or ``"module:function"``, as a numba device function.

    A plain Python function is compiled as one (``cuda.jit(device=True)``); so numba is imported here, which must
    come after the engine chose the simulator's mode (``backends.select_device``).
    """
    from blink.device.numba_compat import cuda
    from blink.device.policy import ARGUMENTS, fcfs

    if policy is None:
        return fcfs
    function = _import_policy(policy) if isinstance(policy, str) else policy
    python = getattr(function, "py_func", function)
    # Checked here: a wrong signature would otherwise fail inside the engine at its first request.
    if not inspect.isfunction(python) or len(inspect.signature(python).parameters) != len(ARGUMENTS):
        raise ValueError(f"the policy {policy!r} must be a function of the request's {', '.join(ARGUMENTS)} that "
                         "returns its key (docs/scheduler.md, \"Writing a policy\")")
    return function if hasattr(function, "py_func") else cuda.jit(device=True)(function)


def _import_policy(policy: str):
    module_name, _, name = policy.partition(":")
    if not module_name or not name:
        raise ValueError(f"a policy path must look like 'package.module:function' (got {policy!r})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import the policy module {module_name!r} ({e}): is it on PYTHONPATH?") from None
    function = getattr(module, name, None)
    if function is None:
        raise ValueError(f"the policy module {module_name!r} has no {name!r}")
    return function
