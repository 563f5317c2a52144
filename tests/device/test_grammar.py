"""The scheduler's grammar walk (device/grammar.py) under the CUDA simulator: on random automata placed anywhere in a
region, the device moves through the same states as the plain Python walk of ``blink.ring.grammar``, and each state
it reaches allows what the automaton's state allows."""
import numpy as np

from blink.device import sim  # noqa: F401  (turns the simulator on before numba is imported)
from blink.device.grammar import next_state
from blink.device.numba_compat import cuda
from blink.ring import grammar as ring_grammar
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
        words, starts, walks, wanted = [np.full(int(rng.integers(0, 9)), -1, np.int32)], [], [], []
        for _ in range(threads):
            grammar, node, transitions, accepting = random_grammar(rng, vocab, eos)
            base = sum(len(w) for w in words)
            words.append(np.frombuffer(grammar.placed(base), "<i4"))
            starts.append(base + grammar.start)
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
