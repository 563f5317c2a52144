"""Random token automata for the grammar tests: a transition table over a small vocabulary, every state reachable
from state 0, some accepting."""
import numpy as np

from blink.ring.grammar import build


def random_automaton(rng: np.random.Generator, vocab: int, eos: tuple[int, ...] = (0,), most: int | None = None):
    """``(initial, transitions, accepting)``: state ids are arbitrary ints (as outlines-core's are), each state allows a
    random set of at most ``most`` tokens (none of ``eos``) going mostly to one state (as a string's body does) and
    sometimes elsewhere."""
    n = int(rng.integers(1, 12))
    ids = rng.choice(10_000, n, replace=False).tolist()
    transitions, accepting = {}, set()
    for k, state in enumerate(ids):
        count = int(rng.integers(0, min(vocab, most or vocab)))
        tokens = [t for t in rng.choice(vocab, count, replace=False).tolist() if t not in eos]
        loop = ids[int(rng.integers(n))]
        transitions[state] = {t: loop if rng.random() < 0.7 else ids[int(rng.integers(n))] for t in tokens}
        if k + 1 < n and tokens:        # the next state reachable
            transitions[state][tokens[0]] = ids[k + 1]
        if not tokens or rng.random() < 0.4:
            accepting.add(state)
    return ids[0], transitions, accepting


def random_grammar(rng: np.random.Generator, vocab: int, eos: tuple[int, ...] = (0,), most: int | None = None):
    """``(grammar, initial, transitions, accepting)`` of a random automaton."""
    initial, transitions, accepting = random_automaton(rng, vocab, eos, most)
    return build(("regex", str(rng.integers(1 << 62))), vocab, initial, transitions, accepting, eos), initial, \
        transitions, accepting
