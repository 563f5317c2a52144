"""A llama-architecture GGUF file (llama.cpp) → an HF-style model directory blink and transformers both load.

Writes ``config.json``, ``model.safetensors`` (float32, exactly the dequantized values), ``tokenizer.json`` (byte-level
BPE built with ``tokenizers`` from the GGUF vocabulary and merges), ``tokenizer_config.json`` (special tokens and the
chat template) and ``generation_config.json``.

llama.cpp stores the rows of each Q and K projection permuted (its RoPE rotates adjacent pairs, HF's rotates the two
halves of a head); ``unpermute_qk`` undoes that so the weights fit HF's rotation again.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from blink.errors import GGUFError

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types
_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# How llama.cpp splits text before BPE, as tokenizers pre-tokenizers, by `tokenizer.ggml.pre`.
_DIGITS_THEN_GPT2 = ("smollm",)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows ``(head, pair, 2)`` back to ``(head, 2, half)``."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, path: Path):
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"{path}: metadata field {key!r} is missing")
    return field.contents()


def hf_config(reader, path: Path) -> dict:
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise GGUFError(f"{path}: general.architecture {arch!r} is not supported (only 'llama')")
    get = lambda key: _field(reader, f"llama.{key}", path)  # noqa: E731
    heads, hidden = get("attention.head_count"), get("embedding_length")
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": hidden // heads, "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base"), "max_position_embeddings": get("context_length"),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in names, "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", path),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", path),
    }


def hf_tensors(reader, config: dict, path: Path) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        block, _, rest = t.name.partition(".")
        if block == "blk":
            layer, base, suffix = rest.split(".")
            name = f"model.layers.{layer}.{_TENSOR_NAMES[base]}.{suffix}"
        else:
            base, suffix = t.name.rsplit(".", 1)
            if base not in _TENSOR_NAMES:
                raise GGUFError(f"{path}: tensor {t.name!r} has no HF counterpart")
            name = f"{_TENSOR_NAMES[base]}.{suffix}"
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def build_tokenizer(reader, path: Path):
    """Byte-level BPE from ``tokenizer.ggml.tokens``/``merges``; control tokens become special added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model", path) != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model must be 'gpt2' (byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    types = _field(reader, "tokenizer.ggml.token_type", path)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = reader.fields.get("tokenizer.ggml.pre")
    if pre is not None and pre.contents() in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED])
    return tok


def tokenizer_config(reader, path: Path) -> dict:
    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "clean_up_tokenization_spaces":
              False, "model_max_length": _field(reader, "llama.context_length", path)}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            config[name] = tokens[field.contents()]
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template.contents()
    return config


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF-style directory for ``gguf_path`` into ``out_dir`` (created); returns ``out_dir``."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = GGUFReader(gguf_path)
    except (OSError, ValueError) as e:
        raise GGUFError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    config = hf_config(reader, gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(reader, config, gguf_path), out_dir / "model.safetensors", metadata={"format": "pt"})
    build_tokenizer(reader, gguf_path).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader, gguf_path), indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
