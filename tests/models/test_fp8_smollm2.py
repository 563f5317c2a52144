"""``--quantization fp8`` on the embedded SmolLM2-135M-Instruct against the unquantized model (both on the CPU
reference path, float32): the stated tolerance of docs/models.md ("FP8 weights")."""
import pytest
import torch

from blink.device.step import StepLayout
from blink.models import load_model
from tests.models.harness import Runner

PROMPTS = [  # held prompts: never used to choose the quantization scheme
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "Water boils at a temperature of",
    "import numpy as np\nx = np.", "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans",
]
TOKENS = 16
# the tolerance docs/models.md states ("FP8 weights", with the drift measured there)
MAX_DRIFT, MEAN_DRIFT, IDENTICAL_SHARE = 1.0, 0.15, 0.5


def decode(model, prompts: list[list[int]], n: int, forced: torch.Tensor | None = None):
    """``n`` steps after one batched prefill of ``prompts``: (``[prompts, n]`` log-probabilities of the fed tokens,
    the model's greedy tokens). Each step feeds the ``forced`` token (``[prompts, n]``) or, without, the greedy one:
    then the greedy tokens are the model's greedy text, and with ``forced`` they equal it wherever that text would
    be ``forced``."""
    runner = Runner(model, num_pages=256, layout=StepLayout(256, 16, 64))
    chunks = [runner.chunk(i, p, 0) for i, p in enumerate(prompts)]
    logprobs, greedy = torch.empty(len(prompts), n), torch.empty(len(prompts), n, dtype=torch.long)
    for j in range(n):
        logits, greedy[:, j], _ = runner.step(chunks)
        fed = greedy[:, j] if forced is None else forced[:, j]
        logprobs[:, j] = torch.log_softmax(logits.float(), -1).gather(1, fed[:, None])[:, 0]
        chunks = [runner.chunk(i, [int(fed[i])], len(p) + j) for i, p in enumerate(prompts)]
    return logprobs, greedy


@pytest.mark.slow
def test_quantization_fp8_drifts_within_the_stated_tolerance(smollm2_dir, smollm2_hf_tokenizer):
    prompts = [smollm2_hf_tokenizer.encode(p) for p in PROMPTS]
    want_logprobs, text = decode(load_model(smollm2_dir, dtype=torch.float32), prompts, TOKENS)
    logprobs, greedy = decode(load_model(smollm2_dir, dtype=torch.float32, quantization="fp8"), prompts, TOKENS,
                              text)
    drift = (logprobs - want_logprobs).abs()
    assert drift.max() <= MAX_DRIFT and drift.mean() <= MEAN_DRIFT, (drift.max(), drift.mean())
    identical = (greedy == text).all(1).float().mean()
    assert identical >= IDENTICAL_SHARE, identical
