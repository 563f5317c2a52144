"""blink.nic.detokenizer against transformers' decode of the embedded SmolLM2's ids (a byte-level vocabulary, which
the window detokenizer serves as well as the byte one: both are held to the same reference)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.nic.detokenizer import ByteDetokenizer, Detokenizer, detokenizer_for
from blink.nic.text import Tokenizer
from blink.nic.token_bytes import decoded_bytes
from tests.nic.test_text import TEXTS


@pytest.fixture(scope="module")
def tok(tokenizer):
    """The embedded model's ``blink.nic.text.Tokenizer`` (tests/conftest.py's)."""
    return tokenizer


@pytest.fixture(params=[Detokenizer, ByteDetokenizer])
def detokenizer(request):
    """Each detokenizer: the one for any vocabulary, and the byte-level one (SmolLM2's is byte-level)."""
    return request.param


def stream_deltas(detok, ids) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_emits_a_split_character(tok, hf, detokenizer, text):
    ids = tok.encode(text)
    if any(ord(c) > 127 for c in text):
        # The test is only meaningful if some character's bytes are split over tokens.
        assert any("\ufffd" in hf.decode([i]) for i in ids)
    deltas = stream_deltas(detokenizer(tok), ids)
    assert "".join(deltas) == hf.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


token_ids = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 49151)), min_size=1, max_size=24)


@settings(max_examples=150, deadline=None)
@given(ids=token_ids)
def test_detokenizer_equals_transformers_decode_of_any_ids(tok, hf, ids):
    """Random ids (biased to single bytes, so invalid and incomplete UTF-8 abounds) and special tokens."""
    for detok in (Detokenizer(tok), ByteDetokenizer(tok)):
        emitted = ""
        for k, token in enumerate(ids, 1):
            emitted += detok.push(token)
            # Nothing emitted may change later: it is a prefix of the decode of every longer sequence.
            assert hf.decode(ids[:k], skip_special_tokens=True).startswith(emitted)
        assert emitted + detok.flush() == hf.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None)
@given(ids=token_ids)
def test_byte_detokenizer_equals_the_decode_of_any_ids_special_tokens_kept(tok, hf, ids):
    detok = ByteDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream_deltas(detok, ids)) == hf.decode(ids, skip_special_tokens=False)


def test_ids_without_a_token_decode_to_nothing(tok, detokenizer):
    """A model's vocabulary may be larger than its tokenizer's (Qwen3: 151,936 rows, 151,669 tokens); tokenizers'
    decode drops such ids."""
    ids = tok.encode("a b") + [tok.vocab_size, tok.vocab_size + 1000] + tok.encode(" c")
    assert "".join(stream_deltas(detokenizer(tok), ids)) == tok.decode(ids) == "a b c"


def test_a_byte_level_vocabulary_gets_the_byte_detokenizer_and_any_other_the_window_one(tok):
    import tokenizers
    assert isinstance(detokenizer_for(tok), ByteDetokenizer) and len(tok.token_bytes) == tok.vocab_size
    spm = tokenizers.Tokenizer(tokenizers.models.WordLevel({"\u2581a": 0, "<unk>": 1}, unk_token="<unk>"))
    spm.decoder = tokenizers.decoders.Metaspace()
    other = object.__new__(Tokenizer)
    other.__dict__.update(tok.__dict__, _tokenizer=spm, token_bytes=decoded_bytes(spm))
    assert other.token_bytes is None and isinstance(detokenizer_for(other), Detokenizer)


def byte_token(tok, byte: int) -> int:
    """The id of the byte-level token of one byte (GPT-2's byte-to-character map: printable bytes are themselves,
    the others 256, 257, ... in order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    other = [b for b in range(256) if b not in printable]
    return tok._tokenizer.token_to_id(chr(byte) if byte in printable else chr(256 + other.index(byte)))


def test_detokenizer_settles_long_runs_of_invalid_utf8_without_changing_the_text(tok, hf, detokenizer):
    """A run of bytes that never completes a character is emitted as it comes (not held to the end), and a
    character split over tokens right after it still comes out whole."""
    garbage = [byte_token(tok, 0x80)] * 40
    ids = tok.encode("a") + garbage + tok.encode("你好") + garbage[:5] + tok.encode(" 👋🏽")
    detok, emitted, held = detokenizer(tok), "", 0
    for k, token in enumerate(ids, 1):
        emitted += detok.push(token)
        assert hf.decode(ids[:k]).startswith(emitted)
        held = max(held, len(hf.decode(ids[:k])) - len(emitted))
    assert emitted + detok.flush() == hf.decode(ids) and "你好" in emitted
    assert held <= Detokenizer.MAX_HELD + 4


@pytest.mark.parametrize("kind", ["special", "invalid UTF-8"])
def test_detokenizer_work_per_token_does_not_grow_with_tokens_it_holds(tok, kind):
    """Regression: special tokens (skipped) and bytes that never complete a character grew the decoded window
    without bound: 8.3 s of CPU per 4,000 tokens against 0.13 s for plain text. Counted in tokens decoded, which a
    busy machine does not change: per token, no more than for plain text of the same length, plus the window."""
    n = 2000
    plain = tok.encode("the quick brown fox jumps over the lazy dog " * 200)[:n]
    held = [sorted(tok.special_ids)[0]] * n if kind == "special" else [byte_token(tok, 0x80)] * n

    class Counting(Tokenizer):
        decoded = 0

        def decode(self, ids, **kw):
            Counting.decoded += len(ids)
            return super().decode(ids, **kw)

    counting = object.__new__(Counting)
    counting.__dict__.update(tok.__dict__)
    work = {}
    for name, ids in (("plain", plain), (kind, held)):
        Counting.decoded = 0
        stream_deltas(Detokenizer(counting), ids)
        work[name] = Counting.decoded
    assert work[kind] <= 2 * work["plain"] + 4 * (Detokenizer.MAX_HELD + 4) * n, work


def test_detokenizer_keeps_special_tokens_when_asked(tok, hf, detokenizer):
    ids = tok.encode_chat([{"role": "user", "content": "hi 👋"}])
    assert "".join(stream_deltas(detokenizer(tok, skip_special_tokens=False), ids)) == hf.decode(ids)
