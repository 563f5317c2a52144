"""The bytes each token of a vocabulary stands for: what a grammar over the model's tokens is compiled against.

A byte-level vocabulary (GPT-2's scheme: SmolLM2, Llama 3, Qwen) writes each byte as one printable character
(``bytes_to_unicode``); a SentencePiece one writes a space as "▁" and, with byte fallback, a lone byte as
``<0xHH>``. Added tokens stand for their text; special tokens for nothing (a grammar never allows them, and the
end-of-sequence tokens are allowed by the automaton's accepting states, not by their text). ``decoded_bytes`` is the
detokenizer's table: what a byte-level decoder makes of every token, special ones included.
"""
from __future__ import annotations

import functools
import json
import re

import tokenizers

SENTENCEPIECE_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_characters() -> dict[int, str]:
    """GPT-2's printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@functools.cache
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte back to the byte."""
    return {c: b for b, c in byte_level_characters().items()}


def _is_byte_level(decoder: dict | None) -> bool:
    if decoder is None:
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", ()))
    return decoder.get("type") == "ByteLevel"


def vocabulary_bytes(tokenizer: tokenizers.Tokenizer) -> dict[bytes, list[int]]:
    """The ids of every non-special token by the bytes it stands for (several ids may stand for the same bytes)."""
    described = json.loads(tokenizer.to_str())
    byte_level = _is_byte_level(described.get("decoder"))
    byte_fallback = bool(described.get("model", {}).get("byte_fallback"))
    added = tokenizer.get_added_tokens_decoder()
    by_bytes: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in added:
            if added[i].special:
                continue
            raw = added[i].content.encode()
        elif byte_level:
            raw = _byte_level_bytes(token)
        elif byte_fallback and (match := _BYTE_TOKEN.fullmatch(token)):
            raw = bytes([int(match.group(1), 16)])
        else:
            raw = token.replace(SENTENCEPIECE_SPACE, " ").encode()
        if raw:
            by_bytes.setdefault(raw, []).append(i)
    return by_bytes


def decoded_bytes(tokenizer: tokenizers.Tokenizer) -> list[bytes] | None:
    """Where the tokenizer's decoder is GPT-2's byte-level one and nothing else: the bytes it makes of each id's
    token, indexed by id (b"" for an id no token has). It maps a token's characters back to bytes where each stands
    for one, else takes the token's UTF-8 (an added token's text, say), and decodes the whole as UTF-8 with U+FFFD
    for what is not: ``tokenizer.decode(ids)`` is the UTF-8 decode of the ids' bytes joined (the special tokens'
    dropped when they are skipped). None for any other decoder."""
    if type(tokenizer.decoder) is not tokenizers.decoders.ByteLevel:
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        table[i] = _byte_level_bytes(token)
    return table


def _byte_level_bytes(token: str) -> bytes:
    """What GPT-2's byte-level decoder makes of ``token``: its characters mapped back to bytes where each stands for
    one, else the token's UTF-8."""
    try:
        return bytes(map(_byte_level_decoding().__getitem__, token))
    except KeyError:
        return token.encode()
