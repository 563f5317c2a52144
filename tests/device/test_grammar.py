"""The scheduler's grammars (device/grammar.py) under the CUDA simulator: on random automata placed anywhere in a
region, the device moves through the same states as the plain Python walk of ``blink.ring.grammar``, and each state
it reaches allows what the automaton's state allows; a placement is mirrored into device memory once per id."""
from dataclasses import replace

import numpy as np

from blink.device import sim  # noqa: F401  (turns the simulator on before numba is imported)
from blink.device.grammar import mirror_placement, next_state
from blink.device.numba_compat import cuda
from blink.ring import grammar as ring_grammar
from blink.ring.grammar import PLACEMENT_WORDS
from tests.grammars import random_grammar


@cuda.jit
def walk_kernel(grammars, start, tokens, mask_words, states):
    """Thread k walks ``tokens[k]`` from ``start[k]``, writing each state it reaches into ``states[k]``."""
    k = cuda.threadIdx.x
    state = start[k]
    for i in range(tokens.shape[1]):
        state = next_state(grammars, state, tokens[k, i], mask_words)
        states[k, i] = state


def test_the_device_walks_random_automata_as_the_python_walk_does():
    rng = np.random.default_rng(1)
    threads, length = 4, 12
    for _ in range(12):
        vocab = int(rng.integers(2, 300))
        eos = (int(rng.integers(vocab)),)
        words, bases, walks, wanted = [np.full(int(rng.integers(0, 9)), -1, np.int32)], [], [], []
        for k in range(threads):
            grammar, node, transitions, accepting = random_grammar(rng, vocab, eos)
            bases.append(sum(len(w) for w in words))
            words.append(np.frombuffer(grammar.placed(bases[-1], k + 1), "<i4"))
            tokens, allowed = [], []
            for _ in range(length):         # an allowed token while there is one (then the walk stops mattering)
                moves = sorted(transitions.get(node, {}))
                token = int(rng.choice(moves)) if moves else int(rng.integers(vocab))
                node = transitions.get(node, {}).get(token)
                tokens.append(token)
                allowed.append(None if node is None else
                               sorted(set(transitions.get(node, {})) - set(eos) | (set(eos) if node in accepting
                                                                                    else set())))
            walks.append(tokens)
            wanted.append(allowed)
        region = np.concatenate(words)
        starts = [ring_grammar.start_state(region, base) for base in bases]
        states = np.zeros((threads, length), np.int32)
        walk_kernel[1, threads](region, np.array(starts, np.int32), np.array(walks, np.int32),
                                ring_grammar.mask_words(vocab), states)
        for k in range(threads):
            state, python = starts[k], []
            for token in walks[k]:
                state = ring_grammar.next_state(region, state, token, vocab)
                python.append(state)
            assert states[k].tolist() == python
            for state, allowed in zip(python, wanted[k]):
                if allowed is None:
                    break
                assert ring_grammar.allowed(region, state, vocab).tolist() == allowed


@cuda.jit
def mirror_kernel(region, mirror, base):
    mirror_placement(region, mirror, base)


def test_a_placement_is_mirrored_unless_the_mirror_holds_its_size_and_id():
    """Copied whole where the mirror lacks it; left alone where the mirror's size and id are the ring's (a mirror
    scribbled on under a matching id stays scribbled: no copy happened); copied again for another placement at the
    same word of the same size, told apart by its id alone."""
    rng = np.random.default_rng(3)
    vocab, base = 100, 5
    grammar = random_grammar(rng, vocab, (1,))[0]
    other = replace(grammar, words=grammar.words ^ 0x5A5A)     # the same size, other words
    region = np.full(base + grammar.placed_words + 7, -3, np.int32)
    mirror = np.zeros_like(region)
    placement = slice(base, base + grammar.placed_words)
    for g, placement_id, copied in ((grammar, 11, True), (grammar, 11, False), (other, 12, True)):
        region[placement] = np.frombuffer(g.placed(base, placement_id), "<i4")
        mirror[base + PLACEMENT_WORDS] = -9     # a record word: overwritten only by a copy
        mirror_kernel[1, 32](region, mirror, base)
        assert (mirror[placement] == region[placement]).all() == copied
        assert mirror[base + PLACEMENT_WORDS] == (region[base + PLACEMENT_WORDS] if copied else -9)
    assert not mirror[:base].any() and not mirror[placement.stop:].any()
