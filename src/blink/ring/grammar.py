"""A compiled grammar as the ring's ``grammars`` region holds it: a token-level automaton in flat int32 words.

The agent compiles a request's structured output (a JSON schema, a regex, a list of choices) into a deterministic
automaton over the model's tokens (``blink.nic.grammars``) and writes it into the region; the request's header names
the word offset of its start state, and the GPU side walks it: per step it masks the row's logits to the state's
allowed tokens and, once the token is sampled, moves to the next state (docs/architecture.md, "Grammars").

A grammar is a run of state records, each starting at a word offset of the region (its *state*)::

    words[p : p + W]          allowed tokens: bit (t % 32) of word p + t // 32 is token t (W = mask_words(vocab))
    words[p + W]              the next state of every allowed token that has no pair below (its default)
    words[p + W + 1]          n: the number of pairs
    words[p + W + 2 : + 2 n]  (token, next state) pairs, sorted by token

A state *accepts* when its mask allows the end-of-sequence tokens: sampling one ends the request there, and an
accepting state with no other allowed token allows only them. ``Grammar.words`` holds the records with states as
offsets from the grammar's first word.

In the region a grammar is *placed*: a header of ``PLACEMENT_WORDS`` words, then its records (``placed``)::

    words[b]                  the placement's size in words, this header included
    words[b + 1], words[b + 2]  its placement id (a nonzero uint64, low word first), new for every placement
    words[b + 3]              the start state (a word offset of the region)
    words[b + 4 : b + size]   the records, their states shifted to where they lie

A request's header names the placement's first word ``b``. The GPU side copies a placement into a mirror of the
region in device memory once, when the first request naming it is collected, and reads only the mirror after; the id
tells it whether the mirror at ``b`` already holds this placement (the agent places a grammar again, under a new id,
only where no request in flight reads the one before). ``allowed`` and ``next_state`` walk a region in plain Python:
the executable spec of what the GPU side does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RECORD_WORDS = 2            # a state record's words after its mask: the default next state, the number of pairs
# A placement's header, by word: its size, its id (two words, low first), its start state; the records follow.
SIZE_WORD, ID_WORD, START_WORD, PLACEMENT_WORDS = 0, 1, 3, 4


def mask_words(vocab_size: int) -> int:
    """Words of one state's token mask over a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True, eq=False)
class Grammar:
    """One compiled automaton: ``words`` (int32, states relative to word 0), ``pointers`` (the indices of the words
    that hold a state, which placing it shifts), ``start`` (the start state), for tokens below ``vocab_size``; ``key``
    names what it was compiled from, ``(kind, canonical text)``, so equal requests share one copy."""

    key: tuple[str, str]
    vocab_size: int
    words: np.ndarray
    pointers: np.ndarray
    start: int
    n_states: int

    @property
    def placed_words(self) -> int:
        """The words a placement of this grammar takes in the region, its header included."""
        return PLACEMENT_WORDS + len(self.words)

    @property
    def nbytes(self) -> int:
        return 4 * self.placed_words

    def placed(self, base: int, placement_id: int) -> bytes:
        """The placement's bytes (header and records) with its first word at word ``base`` of the region."""
        if not 0 < placement_id < 1 << 64:
            raise ValueError(f"a placement id is a nonzero uint64, not {placement_id}")
        records = self.words.copy()
        records[self.pointers] += base + PLACEMENT_WORDS
        header = np.zeros(PLACEMENT_WORDS, np.uint32)
        header[SIZE_WORD] = self.placed_words
        header[ID_WORD:ID_WORD + 2] = placement_id & 0xFFFFFFFF, placement_id >> 32
        header[START_WORD] = base + PLACEMENT_WORDS + self.start
        header = header.view(np.int32)
        return np.concatenate([header, records]).astype("<i4").tobytes()


def build(key: tuple[str, str], vocab_size: int, initial: int, transitions: dict[int, dict[int, int]],
          accepting, eos_token_ids) -> Grammar:
    """The ``Grammar`` of an automaton given as ``transitions[state][token] = next state`` from ``initial``, its
    ``accepting`` states allowing ``eos_token_ids`` (which ``transitions`` may hold too: they are left out, as are
    tokens outside the vocabulary). Each state's default next state is its most common one, so a state that loops on
    most tokens (inside a string) needs few pairs."""
    eos = np.unique(np.asarray(list(eos_token_ids), np.int64))
    eos = eos[(eos >= 0) & (eos < vocab_size)]
    accepting = set(accepting)
    order = [initial] + sorted(set(transitions) - {initial} | accepting - {initial})
    w = mask_words(vocab_size)
    records = []        # per state: its allowed tokens, its default next state, its pairs (tokens, next states)
    for state in order:
        out = transitions.get(state, {})
        tokens = np.fromiter(out.keys(), np.int64, len(out))
        nexts = np.fromiter(out.values(), np.int64, len(out))
        keep = (tokens >= 0) & (tokens < vocab_size) & ~np.isin(tokens, eos)
        tokens, nexts = tokens[keep], nexts[keep]
        sort = np.argsort(tokens, kind="stable")
        tokens, nexts = tokens[sort], nexts[sort]
        values, counts = np.unique(nexts, return_counts=True)
        default = int(values[counts.argmax()]) if len(values) else state
        pairs = nexts != default
        records.append((np.concatenate([tokens, eos]) if state in accepting else tokens, default, tokens[pairs],
                        nexts[pairs]))
    sizes = [w + RECORD_WORDS + 2 * len(pair_tokens) for _, _, pair_tokens, _ in records]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    index = {state: int(offsets[k]) for k, state in enumerate(order)}
    words = np.zeros(int(offsets[-1]), np.int64)
    pointers = []
    for p, (allowed_tokens, default, pair_tokens, pair_nexts) in zip(offsets.tolist(), records):
        bits = np.zeros(w * 32, np.uint8)
        bits[allowed_tokens] = 1
        words[p:p + w] = np.packbits(bits, bitorder="little").view("<u4")
        n = len(pair_tokens)
        words[p + w] = index[default]
        words[p + w + 1] = n
        words[p + w + 2:p + w + 2 + 2 * n:2] = pair_tokens
        words[p + w + 3:p + w + 3 + 2 * n:2] = [index[t] for t in pair_nexts.tolist()]
        pointers.append(np.concatenate([[p + w], np.arange(p + w + 3, p + w + 3 + 2 * n, 2)]))
    return Grammar(key, vocab_size, words.astype(np.uint32).view(np.int32), np.concatenate(pointers), 0, len(order))


def start_state(region: np.ndarray, base: int) -> int:
    """The start state of the grammar placed at word ``base`` of the int32 ``region``."""
    return int(region[base + START_WORD])


def allowed(region: np.ndarray, state: int, vocab_size: int) -> np.ndarray:
    """The token ids state ``state`` of the int32 ``region`` allows, ascending."""
    mask = region[state:state + mask_words(vocab_size)].astype("<i4").view(np.uint8)
    return np.flatnonzero(np.unpackbits(mask, bitorder="little")[:vocab_size])


def next_state(region: np.ndarray, state: int, token: int, vocab_size: int) -> int:
    """The state after ``token`` (allowed in ``state``) of the int32 ``region``."""
    p = state + mask_words(vocab_size)
    for k in range(int(region[p + 1])):
        if int(region[p + 2 + 2 * k]) == token:
            return int(region[p + 3 + 2 * k])
    return int(region[p])
