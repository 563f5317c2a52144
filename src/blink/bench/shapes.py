"""Model directories of a known shape with no weights: for ``load_format="dummy"`` (random weights) benchmarks.

A directory holds ``config.json`` (the shape) and a tokenizer over the whole vocabulary, so that every token id a
random model samples decodes to text and both ``blink serve`` and the peers can read it; the real tokenizer is not
needed because benchmark prompts are token ids. ``words`` (the default): token ``i`` is the word ``t<i>``. ``bytes``:
GPT-2's byte-level scheme, the 256 bytes first, then the words, and an end-of-sequence token last, so that a grammar
(structured outputs: JSON needs ``{``, ``"`` and digits) can be compiled over it and can end.

    python -m blink.bench.shapes DIR [--shape qwen3-8b | tiny-qwen3 | llama-3-8b | phi-4 | qwen3-32b | qwen3-30b-a3b]
        [--tokenizer words | bytes]
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


EOS = "<|endoftext|>"


def byte_tokenizer(vocab_size: int) -> dict:
    """``tokenizer.json`` of a byte-level BPE tokenizer without merges: ids 0-255 the bytes (as GPT-2 writes them),
    then the words ``t256 ..``, and ``EOS`` as the last id (a special token)."""
    from blink.nic.token_bytes import byte_level_characters

    chars = byte_level_characters()
    vocab = {**{chars[b]: b for b in range(256)}, **{f"t{i}": i for i in range(256, vocab_size - 1)}}
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
            "added_tokens": [{"id": vocab_size - 1, "content": EOS, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                                "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": [], "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                      "byte_fallback": False}}


TOKENIZERS = {"words": word_tokenizer, "bytes": byte_tokenizer}


def shape_names() -> list[str]:
    """The shapes above and the paper's four full-size models (``blink.models.shapes``)."""
    return [*SHAPES, *full_size.SHAPES]


def shape_config(shape: str) -> ModelConfig:
    """The ``ModelConfig`` of one of ``shape_names()``."""
    if shape not in shape_names():
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(shape_names())}")
    return SHAPES[shape] if shape in SHAPES else full_size.shape_config(shape)


def write_model_dir(directory, shape: str, tokenizer: str = "words") -> Path:
    """Write ``config.json``, ``tokenizer.json`` (one of ``TOKENIZERS``) and ``tokenizer_config.json`` of ``shape``
    into ``directory``."""
    config = shape_config(shape)
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: one of {', '.join(TOKENIZERS)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
    (directory / "tokenizer.json").write_text(json.dumps(TOKENIZERS[tokenizer](config.vocab_size)))
    described = {"model_max_length": config.max_position_embeddings}
    if tokenizer == "bytes":
        described["eos_token"] = EOS
    (directory / "tokenizer_config.json").write_text(json.dumps(described))
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blink.bench.shapes", description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--shape", choices=shape_names(), default="qwen3-8b")
    parser.add_argument("--tokenizer", choices=tuple(TOKENIZERS), default="words")
    args = parser.parse_args(argv)
    print(write_model_dir(args.directory, args.shape, args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
