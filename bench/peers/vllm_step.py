"""vLLM's decode step at a fixed batch and context, and a prefill, measured beside ``bench/model_bench.py``'s for
blink: the interval between two decode steps, the board's joules per step, and GPU time per kernel
(``bench/kernel_split.py`` sorts both servers' kernels into the same categories). Run where
``bench/peers/vllm_gpu.sh install`` put vLLM:

    PYTHONPATH=$HOME/blink-peers/site:src python -m bench.peers.vllm_step --shape qwen3-8b [--batches 1 16 64]
        [--context 1024] [--steps 512] [--profile-steps 128] [--prefill 2048] [--quantization fp8]
        [--out vllm_step.json]

vLLM's offline engine (``vllm.LLM``: the engine core of its server, without HTTP) on the shape directory with
random weights (``load_format="dummy"``), the limits of ``vllm_gpu.sh serve`` and its prefix cache off, in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that CUPTI sees its kernels. Per batch B: B prompts of random
token ids, ``context - steps // 2`` long, so that the decode steps average ``context`` tokens of context; greedy
(``--temperature 0``, as the served comparisons of docs/benchmarks/peers.md; blink's step graph runs the same sampling
kernels either way) or ``--temperature T --top-p P``; ``ignore_eos``. A run of ``1 + N`` output tokens is the prefill,
the first token and N decode steps, so each measure is the difference of a run of ``1 + N`` tokens and one of 1
token, over N:

- ``step_ms``: wall time per decode step, vLLM's host scheduling between steps included (what its server sees);
- ``power_w``, ``joules_per_step``: NVML energy (``blink.bench.energy``) per decode step and its mean power;
- ``profile``: GPU µs per decode step per kernel (``torch.profiler``, CUDA activity), over ``--profile-steps``; the
  profiles run after every timing (CUPTI slows what runs after it in the same process).

And the prefill of one ``--prefill``-token prompt (model_bench's prefill row; 0: none): runs of one output token
(the prefill step, which samples the first token, and vLLM's host work for the request), ``--prefill-reps`` of them
after a third as many unmetered: their median time, their energy over all of them, and one more profiled.

Rows are written in model_bench's form (``model``, ``kind``, ``batch``, ``context``, ``step_ms``, ``power_w``,
``joules_per_step``, ``profile``) with ``server: "vllm"``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from bench.gpu_timing import kernel_times, step_profile

MAX_MODEL_LEN = 4096                # vllm_gpu.sh serve's limit (blink's serving cap)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine core in this process: CUPTI sees it
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")      # its sampler would compile with nvcc at first use


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[dict]:
    """``batch`` prompts of ``length`` random token ids each (no two alike, so no sharing)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(batch)]


class Engine:
    """vLLM's offline engine on ``model_dir``, with ``vllm_gpu.sh serve``'s limits and no prefix cache."""

    def __init__(self, model_dir: str, temperature: float, top_p: float, prefill_tokens: int,
                 quantization: str | None):
        """``prefill_tokens``: the most prompt tokens one batch brings. vLLM's step budget is raised to it (from the
        16,384 its offline engine takes on an H200), so that a batch's prompts prefill in one step and no measured
        decode step shares a step with a prefill chunk (with 16 profiled steps at B=64 and the default budget, ~20 %
        of the GEMM launches subtracted were mixed steps'); decode steps of at most 256 tokens run the same kernels
        and graphs either way. ``quantization``: vLLM's ``--quantization`` (``fp8``: weights quantized at load)."""
        from vllm import LLM, SamplingParams
        self._params = SamplingParams
        self._sampling = dict(temperature=temperature, top_p=top_p)
        self.llm = LLM(model=model_dir, load_format="dummy", max_model_len=MAX_MODEL_LEN, max_num_seqs=256,
                       max_num_batched_tokens=max(16384, prefill_tokens), gpu_memory_utilization=0.9,
                       enable_prefix_caching=False, seed=0, quantization=quantization)

    def generate(self, batch_prompts: list[dict], tokens: int) -> float:
        """Seconds to generate ``tokens`` tokens for every prompt."""
        params = self._params(max_tokens=tokens, ignore_eos=True, **self._sampling)
        start = time.perf_counter()
        self.llm.generate(batch_prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    def metered(self, batch_prompts: list[dict], tokens: int) -> tuple[float, float | None]:
        """(seconds, joules) of one ``generate``; joules None without NVML."""
        from blink.bench.energy import EnergyMeter
        with EnergyMeter() as meter:
            seconds = self.generate(batch_prompts, tokens)
        return seconds, meter.result(0)["energy_j"]


def timed_row(engine: Engine, shape: str, batch: int, context: int, batch_prompts: list[dict], steps: int) -> dict:
    """The decode step's interval and energy at ``batch`` x ``context`` (module docstring)."""
    engine.generate(batch_prompts, 1 + steps)               # warm-up
    short_s, short_j = engine.metered(batch_prompts, 1)
    long_s, long_j = engine.metered(batch_prompts, 1 + steps)
    joules = (long_j - short_j) / steps if short_j is not None and long_j is not None else None
    return step_row(shape, "decode", batch, context, (long_s - short_s) / steps * 1e3, batch, joules)


def step_row(shape: str, kind: str, batch: int, context: int, step_ms: float, tokens: int,
             joules: float | None) -> dict:
    """A row in model_bench's form for one step of ``tokens`` tokens and ``joules`` (None without NVML), printed."""
    row = dict(server="vllm", model=shape, kind=kind, batch=batch, context=context, step_ms=step_ms,
               tokens_per_s=tokens / step_ms * 1e3)
    if joules is not None:
        row.update(power_w=joules / step_ms * 1e3, joules_per_step=joules, joules_per_token=joules / tokens)
    print(f"  vLLM {kind} B={batch:4d} ctx={context:5d}: {step_ms:7.3f} ms per step"
          + (f", {row['power_w']:.0f} W, {row['joules_per_step']:.4f} J per step" if joules is not None else ""),
          flush=True)
    return row


def add_profile(engine: Engine, row: dict, batch_prompts: list[dict], profile_steps: int) -> None:
    """GPU µs per decode step per kernel: a run of ``1 + profile_steps`` tokens less a run of 1, over the steps."""
    short = kernel_times(lambda: engine.generate(batch_prompts, 1))
    long = kernel_times(lambda: engine.generate(batch_prompts, 1 + profile_steps))
    kernels = []
    for name, (count, us) in long.items():
        short_count, short_us = short.get(name, (0, 0.0))
        if us > short_us:
            kernels.append(dict(kernel=name, per_step=(count - short_count) / profile_steps,
                                us_per_step=(us - short_us) / profile_steps))
    print(f"  vLLM decode B={row['batch']:4d} ctx={row['context']:5d}:", flush=True)
    row["profile"] = step_profile(kernels, row["step_ms"])


def prefill_row(engine: Engine, shape: str, length: int, vocab: int, reps: int) -> dict:
    """One prompt of ``length`` tokens prefilled and its first token sampled (module docstring), profiled last."""
    from blink.bench.energy import EnergyMeter
    prompt = prompts(1, length, vocab, seed=length)
    for _ in range(1 + reps // 3):          # warm-up, and NVML's averaged reading settles on the load (replay_power)
        engine.generate(prompt, 1)
    with EnergyMeter() as meter:
        seconds = [engine.generate(prompt, 1) for _ in range(reps)]
    joules = meter.result(0)["energy_j"]
    row = step_row(shape, "prefill", 1, length, statistics.median(seconds) * 1e3, length,
                   joules / reps if joules is not None else None)
    kernels = [dict(kernel=name, per_step=count, us_per_step=us)
               for name, (count, us) in kernel_times(lambda: engine.generate(prompt, 1)).items()]
    row["profile"] = step_profile(kernels, row["step_ms"])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of blink.bench.shapes (random weights)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=512, help="decode steps of each timed run")
    parser.add_argument("--profile-steps", type=int, default=128, help="decode steps of each profiled run")
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the prefilled prompt (0: none)")
    parser.add_argument("--prefill-reps", type=int, default=60, help="metered runs (~3 s at 2048 tokens on an H200, "
                        "as model_bench's power: NVML's reading lags the load)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="vLLM's --quantization (bf16: none)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "vllm_step.json"))
    args = parser.parse_args()
    if not 0 < args.steps // 2 < args.context or args.context + args.steps // 2 > MAX_MODEL_LEN:
        parser.error(f"--context {args.context} and --steps {args.steps}: the prompts (context - steps/2) must be "
                     f"non-empty and context + steps/2 within the {MAX_MODEL_LEN}-token limit")
    if not 0 <= args.prefill < MAX_MODEL_LEN:
        parser.error(f"--prefill {args.prefill}: 0 (none) or a prompt length below the {MAX_MODEL_LEN}-token limit")
    if args.prefill_reps < 1:
        parser.error(f"--prefill-reps {args.prefill_reps}: at least 1")

    import torch
    import vllm
    from blink.bench.shapes import write_model_dir
    from blink.models import ModelConfig

    model_dir = str(write_model_dir(os.path.join(tempfile.mkdtemp(), args.shape), args.shape))
    vocab = ModelConfig.from_file(model_dir).vocab_size
    prompt_len = args.context - args.steps // 2
    engine = Engine(model_dir, args.temperature, args.top_p, prefill_tokens=max(args.batches) * prompt_len,
                    quantization=args.quantization)
    batch_prompts = {b: prompts(b, prompt_len, vocab, seed=b) for b in args.batches}
    label = args.shape if args.quantization is None else f"{args.shape}-{args.quantization}"  # model_bench's name
    rows = [timed_row(engine, label, b, args.context, batch_prompts[b], args.steps) for b in args.batches]
    for row in rows:
        add_profile(engine, row, batch_prompts[row["batch"]], args.profile_steps)
    if args.prefill:
        rows.append(prefill_row(engine, label, args.prefill, vocab, args.prefill_reps))
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, vllm=vllm.__version__, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
