"""The step's grammar mask (kernels/grammar.py) against the plain Python reading of the ring's format: on random
automata placed in a region, each row keeps exactly the logits of the tokens its state allows; rows without a
grammar keep all of theirs, whether every row is masked (the capturable kernel) or only those with a grammar (the CPU
step's)."""
import numpy as np
import torch

from blink.models.kernels.grammar import apply_grammar, apply_grammar_rows
from blink.ring.grammar import allowed
from tests.grammars import random_grammar


def test_each_row_keeps_the_logits_its_state_allows():
    rng = np.random.default_rng(5)
    for _ in range(20):
        vocab = int(rng.integers(1, 200))
        grammar = random_grammar(rng, vocab, (int(rng.integers(vocab)),))[0]
        base = int(rng.integers(0, 30))
        region = np.concatenate([np.full(base, -1, np.int32), np.frombuffer(grammar.placed(base), "<i4")])
        records = sorted({base + grammar.start} | {int(w) for w in region[base + grammar.pointers]})
        states = [int(rng.choice(records)) if rng.random() < 0.8 else -1 for _ in range(6)]
        logits = torch.randn(6, vocab)
        masked = logits.clone()
        apply_grammar(masked, torch.from_numpy(region), torch.tensor(states, dtype=torch.int32))
        rows = logits.clone()           # the CPU step's: only the rows with a grammar, the same result
        apply_grammar_rows(rows, torch.from_numpy(region), torch.tensor(states, dtype=torch.int32))
        assert torch.equal(rows, masked)
        for r, state in enumerate(states):
            keep = np.arange(vocab) if state < 0 else allowed(region, state, vocab)
            assert torch.isfinite(masked[r]).nonzero().flatten().tolist() == keep.tolist()
            assert torch.equal(masked[r, keep], logits[r, keep])
