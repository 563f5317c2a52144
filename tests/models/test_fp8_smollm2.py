"""``--quantization fp8`` and ``--kv-cache-dtype fp8`` on the embedded SmolLM2-135M-Instruct against the unquantized
model (all on the CPU reference path, float32): the stated tolerances of docs/models.md ("FP8 weights", "FP8 KV
cache")."""
import pytest
import torch

from blink.models import load_model
from tests.models.harness import decode

PROMPTS = [  # held prompts: never used to choose the quantization scheme
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "Water boils at a temperature of",
    "import numpy as np\nx = np.", "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans",
]
TOKENS = 16
# the tolerance docs/models.md states ("FP8 weights", with the drift measured there)
MAX_DRIFT, MEAN_DRIFT, IDENTICAL_SHARE = 1.0, 0.15, 0.5
# the same for an FP8 KV cache ("FP8 KV cache"; measured at 0.22, 0.040 and 5 of 8)
KV_MAX_DRIFT, KV_MEAN_DRIFT, KV_IDENTICAL_SHARE = 0.5, 0.08, 0.5


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


@pytest.mark.slow
def test_an_fp8_kv_cache_drifts_within_the_stated_tolerance(smollm2_dir, smollm2_hf_tokenizer):
    """``--kv-cache-dtype fp8``: the unquantized model with its K and V kept in e4m3."""
    from blink.models.e4m3 import FP8

    prompts = [smollm2_hf_tokenizer.encode(p) for p in PROMPTS]
    model = load_model(smollm2_dir, dtype=torch.float32)
    want_logprobs, text = decode(model, prompts, TOKENS)
    logprobs, greedy = decode(model, prompts, TOKENS, text, kv_dtype=FP8)
    drift = (logprobs - want_logprobs).abs()
    identical = (greedy == text).all(1).float().mean()
    assert drift.max() <= KV_MAX_DRIFT and drift.mean() <= KV_MEAN_DRIFT, (drift.max(), drift.mean())
    assert identical >= KV_IDENTICAL_SHARE, identical
