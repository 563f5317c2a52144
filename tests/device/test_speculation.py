"""The scheduler's n-gram drafts (device/speculation.py) under the CUDA simulator against a plain Python prompt
lookup: on random token sequences with repeats (prompt in the ring's prompt area, outputs in its output area, the
last token apart), each slot's drafts are the tokens that followed the latest earlier occurrence of its last n
tokens, for the largest n in [min, max] that has one, cut to the drafts asked for."""
from typing import NamedTuple

import numpy as np
from numba import int64

from blink.device import sim  # noqa: F401  (turns the simulator on before numba is imported)
from blink.device.arrays import filled
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS
from blink.device.numba_compat import cuda
from blink.device.speculation import lookup
from blink.device.state import CFG_DTYPE


class Sequences(NamedTuple):
    """The fields of ``SchedulerArrays`` that ``lookup`` reads and writes."""

    cfg: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray
    seq_prompt_len: np.ndarray
    seq_total: np.ndarray
    seq_last: np.ndarray
    seq_draft: np.ndarray


@cuda.jit
def lookup_kernel(s, most, counts):
    """One block looks every slot up in turn, as ``propose`` does."""
    best = cuda.shared.array(1, int64)
    for slot in range(counts.shape[0]):
        count = lookup(s, best, slot, most[slot])
        if cuda.threadIdx.x == 0:
            counts[slot] = count


def reference(tokens: list[int], most: int, low: int, high: int) -> list[int]:
    if most == 0:
        return []
    for n in range(high, low - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + most]
    return []


def test_the_device_drafts_what_prompt_lookup_finds():
    rng = np.random.default_rng(3)
    slots, width = 8, 40
    for _ in range(25):
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        cfg = filled(CFG_DTYPE, spec_min=low, spec_max=high)
        # Small vocabularies and a repeated phrase: matches of every length, and sometimes none.
        sequences = []
        for _ in range(slots):
            vocab = int(rng.integers(2, 12))
            phrase = rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
            tokens = []
            while len(tokens) < int(rng.integers(2, width)):
                tokens += phrase if rng.random() < 0.5 else rng.integers(0, vocab, 3).tolist()
            sequences.append(tokens[:width])
        s = Sequences(cfg, np.full((slots, width), -1, np.int32), np.full((slots, width), -1, np.int32),
                      np.zeros(slots, np.int32), np.zeros(slots, np.int32), np.zeros(slots, np.int32),
                      np.full((slots, MAX_SPECULATIVE_TOKENS), -1, np.int32))
        for slot, tokens in enumerate(sequences):
            prompt_len = int(rng.integers(1, len(tokens)))     # the last token is always generated
            s.prompts[slot, :prompt_len] = tokens[:prompt_len]
            s.outputs[slot, :len(tokens) - prompt_len - 1] = tokens[prompt_len:-1]
            s.seq_prompt_len[slot], s.seq_total[slot], s.seq_last[slot] = prompt_len, len(tokens), tokens[-1]
        most = rng.integers(0, MAX_SPECULATIVE_TOKENS + 1, slots).astype(np.int32)
        counts = np.zeros(slots, np.int32)
        lookup_kernel[1, int(rng.choice([1, 3, 8]))](s, most, counts)
        for slot, tokens in enumerate(sequences):
            want = reference(tokens, int(most[slot]), low, high)
            assert s.seq_draft[slot, :counts[slot]].tolist() == want, (tokens, low, high, int(most[slot]))
