"""The grammars region's format (blink.ring.grammar): a compiled automaton, walked through the flat words, is the
automaton it was built from, wherever it is placed."""
import numpy as np
import pytest

from blink.ring.grammar import PLACEMENT_WORDS, RECORD_WORDS, allowed, build, mask_words, next_state, start_state
from tests.grammars import random_grammar


def test_a_placed_grammar_walks_like_its_automaton():
    rng = np.random.default_rng(0)
    for _ in range(100):
        vocab = int(rng.integers(1, 80))
        eos = (int(rng.integers(vocab)),)
        grammar, initial, transitions, accepting = random_grammar(rng, vocab, eos)
        base = int(rng.integers(0, 50))
        region = np.concatenate([np.full(base, -7, np.int32), np.frombuffer(grammar.placed(base, 1), "<i4")])
        state, node = start_state(region, base), initial
        for _ in range(20):
            want = sorted(t for t in transitions.get(node, {}) if t not in eos)
            want = sorted(want + list(eos)) if node in accepting else want
            assert allowed(region, state, vocab).tolist() == want
            moves = [t for t in want if t not in eos]
            if not moves:
                break
            token = int(rng.choice(moves))
            state, node = next_state(region, state, token, vocab), transitions[node][token]
        assert grammar.n_states == len(set(transitions) | accepting | {initial})


def test_a_state_record_is_its_mask_then_its_default_pairs_and_their_count():
    assert mask_words(64) == 2 and mask_words(65) == 3 and RECORD_WORDS == 2
    grammar = build(("regex", "x"), 70, 5, {5: {3: 5, 66: 5, 9: 8}}, {8}, (1, 2))
    words = grammar.words
    assert grammar.start == 0 and grammar.n_states == 2
    assert words[0] == (1 << 3) | (1 << 9) and words[1] == 0 and words[2] == 1 << 2   # tokens 3, 9 and 66
    second = 5 + 2                              # the first record: mask, default, one pair (9 -> state 8)
    assert words[3] == 0 and words[4] == 1 and (words[5], words[6]) == (9, second)
    assert words[second] == 0b110 and words[second + 3] == second and words[second + 4] == 0   # EOS only, no pairs
    placed = np.frombuffer(grammar.placed(100, 1), "<i4")[PLACEMENT_WORDS:]
    first = 100 + PLACEMENT_WORDS               # the records follow the placement's header
    assert placed[3] == first and placed[6] == first + second and placed[second + 3] == first + second


def test_a_placement_starts_with_its_size_id_and_start_state():
    grammar = build(("regex", "x"), 70, 5, {5: {3: 5, 66: 5, 9: 8}}, {8}, (1, 2))
    placement_id = (7 << 40) | 0xFFFFFFFF         # both halves of the id matter, the low one with its top bit set
    placed = np.frombuffer(grammar.placed(100, placement_id), "<u4")
    assert len(placed) == grammar.placed_words == PLACEMENT_WORDS + len(grammar.words)
    assert grammar.nbytes == 4 * len(placed)
    assert placed[0] == len(placed) and (int(placed[2]) << 32 | int(placed[1])) == placement_id
    region = np.concatenate([np.zeros(100, np.int32), placed.view(np.int32)])
    assert start_state(region, 100) == 100 + PLACEMENT_WORDS + grammar.start
    for bad in (0, 1 << 64):
        with pytest.raises(ValueError, match="placement id"):
            grammar.placed(100, bad)


def test_a_ring_with_grammars_needs_the_vocabulary():
    from blink.ring.geometry import RingGeometry
    with pytest.raises(ValueError, match="vocab_size"):
        RingGeometry(max_grammar_bytes=4096)
