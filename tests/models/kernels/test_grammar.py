"""The step's grammar mask (Triton, kernels/grammar.py, and the CPU step's torch reference) against the plain Python
reading of the ring's format: on random automata placed in a region, each row keeps exactly the logits of the tokens
its state allows, unchanged; rows without a grammar keep all of theirs. Vocabularies span several of the kernel's
blocks and end inside one."""
import numpy as np
import torch

from blink.models.kernels import reference
from blink.ring.grammar import PLACEMENT_WORDS, allowed, start_state
from tests.grammars import random_grammar


def _case(rng, vocab: int, rows: int):
    """A region holding one random grammar at a random offset, and ``rows`` states: its records, or -1."""
    grammar = random_grammar(rng, vocab, (int(rng.integers(vocab)),), most=400)[0]
    base = int(rng.integers(0, 30))
    region = np.concatenate([np.full(base, -1, np.int32), np.frombuffer(grammar.placed(base, 1), "<i4")])
    pointers = region[base + PLACEMENT_WORDS + grammar.pointers]
    records = sorted({start_state(region, base)} | {int(w) for w in pointers})
    return region, [int(rng.choice(records)) if rng.random() < 0.8 else -1 for _ in range(rows)]


def _check(apply, device, dtype, seed: int, vocabs):
    rng = np.random.default_rng(seed)
    for vocab in vocabs:
        region, states = _case(rng, vocab, 6)
        logits = torch.randn(6, vocab, device=device).to(dtype)
        masked = logits.clone()
        apply(masked, torch.from_numpy(region).to(device), torch.tensor(states, dtype=torch.int32, device=device))
        for r, state in enumerate(states):
            keep = np.arange(vocab) if state < 0 else allowed(region, state, vocab)
            assert torch.isfinite(masked[r]).nonzero().flatten().tolist() == keep.tolist()
            assert torch.equal(masked[r, keep], logits[r, keep])


def test_the_kernel_keeps_the_logits_each_state_allows(backend):
    from blink.models.kernels.grammar import BLOCK, apply_grammar

    device, dtype, _ = backend
    _check(apply_grammar, device, dtype, 5, [1, 31, 33, BLOCK, BLOCK + 1, 2 * BLOCK + 77])


def test_the_reference_keeps_the_logits_each_state_allows():
    vocabs = [int(v) for v in np.random.default_rng(6).integers(1, 300, 20)]
    _check(reference.apply_grammar, "cpu", torch.float32, 6, vocabs)
