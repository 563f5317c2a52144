"""Token ids in, text deltas out, never splitting a UTF-8 character across deltas: ``ByteDetokenizer`` for a byte-level
vocabulary (SmolLM2, Llama 3, Qwen), ``Detokenizer`` for any other; ``detokenizer_for`` picks. Invariant of both: the
deltas of ``push`` calls (one per token) followed by ``flush()`` concatenate to ``tokenizer.decode(all ids)``.
"""
from __future__ import annotations

import codecs
from typing import Protocol

_REPLACEMENT = "\ufffd"     # what a decoder emits for bytes that are not (yet) a whole UTF-8 character


class Tokenizer(Protocol):
    """What a detokenizer reads of ``blink.nic.text.Tokenizer``."""

    special_ids: frozenset[int]
    token_bytes: list[bytes] | None         # each id's bytes where the vocabulary is byte-level, else None

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str: ...


def detokenizer_for(tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> ByteDetokenizer | Detokenizer:
    """``ByteDetokenizer`` where ``tokenizer``'s vocabulary is byte-level (``Tokenizer.token_bytes``), else
    ``Detokenizer``."""
    if tokenizer.token_bytes is not None:
        return ByteDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)


class ByteDetokenizer:
    """Token ids in, text deltas out, for a byte-level vocabulary (``Tokenizer.token_bytes``): each token's bytes
    through an incremental UTF-8 decoder, which holds back only the bytes of an unfinished character and replaces an
    invalid sequence as soon as it is one, as the one-shot decode does. A push is a lookup and a decode of a few
    bytes (~0.3 us, where ``Detokenizer`` decodes two windows of ids: ~2 us), whatever came before it."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._bytes = tokenizer.token_bytes
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skipped or token_id >= len(self._bytes):
            return ""           # what decode drops: a skipped special token, an id without a token
        return self._utf8.decode(self._bytes[token_id])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class Detokenizer:
    """Token ids in, text deltas out, for any vocabulary.

    Each push decodes a short window ``ids[prefix:]`` and emits what it adds to ``decode(ids[prefix:read])``. A
    window whose text ends in U+FFFD may end inside a character whose next bytes are in the next token, so its text
    is held back. Every emitted delta therefore ends on a whole character, where byte-level decoding is
    self-synchronising, and the windows' pieces join up to the whole decode. ``flush`` emits what is held (with
    replacement characters if the bytes never completed).

    A push costs at most a window of ``MAX_HELD`` + 3 tokens: a skipped special token decodes to nothing and never
    enters it, and a window that held back more than ``MAX_HELD`` tokens is not waiting for one character (at most 4
    bytes), so it emits up to a boundary before its last 3 tokens whose text is final (``_settle``). Windows grew
    without bound on such tokens: 8.3 s of CPU per 4,000 against 0.13 s for plain text.
    """

    MAX_HELD = 8

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0        # window start: the previous emission's start
        self._read = 0          # ids[:read] are emitted

    def push(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""           # what decode(skip_special_tokens=True) drops
        self.ids.append(token_id)
        prefix_text, text = self._window()
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return self._settle(prefix_text, text) if len(self.ids) - self._read > self.MAX_HELD else ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text):]

    def _settle(self, prefix_text: str, text: str) -> str:
        """Emit the held window up to a token boundary before its last 3 tokens (which hold any unfinished character)
        where its text is final: the decode up to the boundary is a prefix of the window's (a boundary inside a
        character decodes it as U+FFFD instead; a character spans at most 4 tokens, so 4 boundaries are tried)."""
        end = len(self.ids) - 3
        for split in range(end, max(self._read, end - 4), -1):
            head = self.tokenizer.decode(self.ids[self._prefix:split], skip_special_tokens=self.skip_special_tokens)
            if len(head) > len(prefix_text) and text.startswith(head):
                self._prefix, self._read = self._read, split
                return head[len(prefix_text):]
        return ""

    def flush(self) -> str:
        prefix_text, text = self._window()
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        return (decode(self.ids[self._prefix:self._read], skip_special_tokens=skip),
                decode(self.ids[self._prefix:], skip_special_tokens=skip))
