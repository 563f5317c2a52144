"""GGUF → HF directory: the tokenizer agrees with transformers' GGUF tokenizer, Q/K rows are un-permuted, and bad
files are refused by name."""
import numpy as np
import pytest
from tokenizers import Tokenizer

from blink.models.from_gguf import GGUFError, convert, unpermute_qk

CORPUS = [
    "Hello, world! The year 2024 had 366 days; π ≈ 3.14159.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Ça va très bien, merci — ¿y tú?",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다. Привет, как дела? مرحبا بالعالم",
    "Emoji: 🤖👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 and a lone surrogate-free string ✓",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < N; ++i) {\r\n\tsum += a[i] * b[i];\t// dot\r\n}",
    "   leading spaces, trailing spaces   \n\n\n\tmixed\t \t whitespace     runs          end",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|endoftext|>",
    "URLs https://example.com/a?b=c&d=e#f and e-mails a.b@c.de, numbers 1,234,567.89 and 0xDEADBEEF",
    "",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir, smollm2_hf_tokenizer):
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for text in CORPUS:
        ids = ours.encode(text).ids
        assert ids == smollm2_hf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == smollm2_hf_tokenizer.decode(ids) == text
        assert ours.decode(ids) == smollm2_hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_and_special_tokens(smollm2_dir, smollm2_hf_tokenizer):
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        smollm2_hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (converted.eos_token, converted.bos_token) == ("<|im_end|>", "<|im_start|>")


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the reference being inverted)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head):
    w = np.random.default_rng(n_head).standard_normal((n_head * 8, 5))
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)


def test_unsupported_and_unreadable_files(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="general.architecture 'qwen2' is not supported"):
        convert(path, tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="junk.gguf: not a readable GGUF file"):
        convert(tmp_path / "junk.gguf", tmp_path / "out")
