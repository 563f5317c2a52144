"""Model directories of a known shape with no weights: for ``load_format="dummy"`` (random weights) benchmarks.

A directory holds ``config.json`` (the shape) and a word-level tokenizer over the whole vocabulary (token ``i`` is
the word ``t<i>``), so that every token id a random model samples decodes to text and both ``blink serve`` and the
transformers peer can read it; the real tokenizer is not needed because benchmark prompts are token ids.

    python -m blink.bench.shapes DIR [--shape qwen3-8b | tiny-qwen3 | llama-3-8b | phi-4 | qwen3-32b | qwen3-30b-a3b]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blink.models import ModelConfig
from blink.models import shapes as full_size

SHAPES = {
    "qwen3-8b": ModelConfig("Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1e6, rotary_dim=128, max_position_embeddings=40960),
    # Small enough for CPU tests and dry runs of the GPU recipe.
    "tiny-qwen3": ModelConfig("Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                              rope_theta=1e6, rotary_dim=16, max_position_embeddings=4096, dtype="float32"),
}


def word_tokenizer(vocab_size: int) -> dict:
    """``tokenizer.json`` of a whitespace word-level tokenizer whose vocabulary is ``t0 .. t<vocab_size - 1>``."""
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)}, "unk_token": "t0"}}


def shape_names() -> list[str]:
    """The shapes above and the paper's four full-size models (``blink.models.shapes``)."""
    return [*SHAPES, *full_size.SHAPES]


def write_model_dir(directory, shape: str) -> Path:
    """Write ``config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` of ``shape`` into ``directory``."""
    if shape not in shape_names():
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(shape_names())}")
    config = SHAPES[shape] if shape in SHAPES else full_size.shape_config(shape)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
    (directory / "tokenizer.json").write_text(json.dumps(word_tokenizer(config.vocab_size)))
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": config.max_position_embeddings}))
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blink.bench.shapes", description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--shape", choices=shape_names(), default="qwen3-8b")
    args = parser.parse_args(argv)
    print(write_model_dir(args.directory, args.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
