"""The scheduler's n-gram drafts (device/speculation.py) under the CUDA simulator against a plain Python prompt
lookup (``references.prompt_lookup``): each slot's drafts are the tokens that followed the latest earlier occurrence
of its last n tokens, for the largest n in [min, max] that has one, cut to the drafts asked for.

The lookup reads a decoding sequence's tokens from the step's token history through its block table, never from
the ring (issue 42: on the GPU the ring is host memory, a PCIe round trip a token): ``lookup`` alone on random
sequences laid out in pages, and the whole scheduler serving copy-prone requests, each checked with the ring's
prompt and output areas overwritten once the tokens were fed.
"""
from typing import NamedTuple

import numpy as np

from blink.device import sim  # noqa: F401  (turns the simulator on before numba is imported)
from blink.device.arrays import filled
from blink.device.config import SchedulerConfig, SpeculativeConfig
from blink.device.numba_compat import cuda
from blink.device.sim import SimScheduler
from blink.device.speculation import lookup
from blink.device.state import CFG_DTYPE
from blink.device.step import StepBuffers, StepLayout
from blink.nic.agent import Agent
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS, RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.reference import expected_output
from blink.ring.request import SamplingParams
from blink.ring.standin import standin_step
from blink.ring.transport import LocalMemory
from tests.device.references import prompt_lookup


class Sequences(NamedTuple):
    """The fields of ``SchedulerArrays`` that ``lookup`` reads and writes."""

    cfg: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray
    seq_prompt_len: np.ndarray
    seq_total: np.ndarray
    seq_computed: np.ndarray
    seq_last: np.ndarray
    seq_draft: np.ndarray
    seq_pages: np.ndarray
    history_tokens: np.ndarray


@cuda.jit
def lookup_kernel(s, slots, most, offsets, best, partial):
    """One block looks the sequences in ``slots`` up together, as ``propose`` does."""
    lookup(s, slots, slots.shape[0], most, offsets, best, partial)


def random_sequences(rng, slots: int, width: int) -> list[list[int]]:
    """Small vocabularies and a repeated phrase: matches of every length, and sometimes none."""
    sequences = []
    for _ in range(slots):
        vocab = int(rng.integers(2, 12))
        phrase = rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
        tokens = []
        while len(tokens) < int(rng.integers(2, width)):
            tokens += phrase if rng.random() < 0.5 else rng.integers(0, vocab, 3).tolist()
        sequences.append(tokens[:width])
    return sequences


def decoding(rng, sequences: list[list[int]], width: int, cfg: np.ndarray) -> Sequences:
    """Each sequence as the scheduler holds it while it decodes: all but its last token fed, so in the token history
    at the cells of its block table (pages dealt at random from one pool), the last one in ``seq_last``; the
    history's other cells, and the last token's own (where a rejected draft was fed), hold other tokens. The ring
    holds the prompt and outputs."""
    slots, page = len(sequences), int(cfg[0].page_size)
    pages_per_seq = -(-width // page)
    pool = rng.permutation(slots * pages_per_seq + 3).astype(np.int32)
    s = Sequences(cfg, np.full((slots, width), -1, np.int32), np.full((slots, width), -1, np.int32),
                  np.zeros(slots, np.int32), np.zeros(slots, np.int32), np.zeros(slots, np.int32),
                  np.zeros(slots, np.int32), np.full((slots, MAX_SPECULATIVE_TOKENS), -1, np.int32),
                  pool[:slots * pages_per_seq].reshape(slots, pages_per_seq),
                  rng.integers(100, 200, pool.size * page).astype(np.int32))
    for slot, tokens in enumerate(sequences):
        prompt_len = int(rng.integers(1, len(tokens)))     # the last token is always generated
        s.prompts[slot, :prompt_len] = tokens[:prompt_len]
        s.outputs[slot, :len(tokens) - prompt_len - 1] = tokens[prompt_len:-1]
        for position, token in enumerate(tokens[:-1]):
            s.history_tokens[s.seq_pages[slot, position // page] * page + position % page] = token
        s.seq_prompt_len[slot], s.seq_total[slot], s.seq_last[slot] = prompt_len, len(tokens), tokens[-1]
        s.seq_computed[slot] = len(tokens) - 1
    return s


def check_lookups(seed: int, scribble: bool):
    """25 rounds of 8 random sequences, random n ranges, pages and block sizes; ``scribble``: the ring's prompt and
    output areas overwritten with other tokens of the same vocabularies before the lookup."""
    rng = np.random.default_rng(seed)
    slots, width = 8, 40
    for _ in range(25):
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        cfg = filled(CFG_DTYPE, page_size=int(rng.integers(1, 6)), spec_min=low, spec_max=high)
        sequences = random_sequences(rng, slots, width)
        s = decoding(rng, sequences, width, cfg)
        if scribble:
            s.prompts[...] = rng.integers(0, 12, s.prompts.shape)
            s.outputs[...] = rng.integers(0, 12, s.outputs.shape)
        order = rng.permutation(slots).astype(np.int32)           # running order is not slot order
        most = rng.integers(0, MAX_SPECULATIVE_TOKENS + 1, slots).astype(np.int32)
        counts = most.copy()
        threads = int(rng.choice([1, 3, 8]))
        lookup_kernel[1, threads](s, order, counts, np.zeros(slots, np.int32), np.zeros(slots, np.int64),
                                  np.zeros(threads, np.int32))
        for i, slot in enumerate(order):
            tokens = sequences[slot]
            want = prompt_lookup(tokens, int(most[i]), low, high)
            assert s.seq_draft[slot, :counts[i]].tolist() == want, (tokens, low, high, int(most[i]))


def test_the_device_drafts_what_prompt_lookup_finds():
    check_lookups(seed=3, scribble=False)


def test_the_lookup_reads_the_token_history_not_the_ring():
    """Regression (issue 42): with the ring's prompt and output areas overwritten, the drafts are still the ones the
    real tokens give."""
    check_lookups(seed=4, scribble=True)


VOCAB = 6       # the stand-in's outputs repeat the prompt's tokens: drafts are found, and some confirmed
GEOMETRY = RingGeometry(n_slots=4, max_prompt_tokens=24, max_output_tokens=16, max_stop_ids=1, prefix_page_size=4)
CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, page_size=4, num_pages=40, max_model_len=40,
                         buckets=(4, 8, 16, 32), eos_token_ids=(), block_threads=4,
                         speculative=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                                       prompt_lookup_max=2))


def test_the_scheduler_drafts_from_the_tokens_its_steps_were_fed():
    """Regression (issue 42), the whole scheduler with the stand-in step (which records its tokens in the history as
    a model's does): after every iteration the ring's prompt and output areas of each request whose prompt is
    computed are overwritten (the agent has read its outputs by then). Every step's drafts are still prompt
    lookup's over the real tokens, through a prefix-cache hit (the second request's first pages were recorded by
    the first) and accepted drafts, and the outputs are the stand-in's."""
    layout = RingLayout(GEOMETRY)
    memory = LocalMemory(layout.size)
    memory.write(0, layout.control_bytes())
    agent = Agent(memory, GEOMETRY)
    step = StepBuffers(StepLayout(CONFIG.buckets[-1], CONFIG.max_num_seqs, CONFIG.max_pages_per_seq))
    scheduler = SimScheduler(layout.view(memory.buffer), GEOMETRY, CONFIG, step, threads=4,
                             step_fn=lambda arrays, bucket: standin_step(arrays, bucket, VOCAB))
    s = scheduler.arrays
    spec = CONFIG.speculative
    rng = np.random.default_rng(5)
    first = list(range(VOCAB)) * 3
    prompts = {1: first, 2: first[:16] + [5, 4, 3]}           # seed -> prompt; the second shares 4 pages
    expected = {seed: expected_output(prompt, SamplingParams(max_tokens=14, seed=seed, ignore_eos=True),
                                      vocab_size=VOCAB)[0] for seed, prompt in prompts.items()}
    ids, outputs, checked = {}, {}, 0
    for iteration in range(200):
        if iteration in (0, 3):
            seed = 1 if iteration == 0 else 2
            ids[agent.submit(prompts[seed], SamplingParams(max_tokens=14, seed=seed, ignore_eos=True))] = seed
        scheduler.iteration()
        for i in range(int(s.sched[0].running)):
            slot = int(s.running[i])
            seed, k = int(s.seq_seed[slot]), int(s.seq_ndraft[slot])
            tokens = (prompts[seed] + expected[seed])[:int(s.seq_total[slot])]
            assert s.seq_draft[slot, :k].tolist() == prompt_lookup(tokens, k, spec.prompt_lookup_min,
                                                                     spec.prompt_lookup_max)
            checked += k
        for out in agent.poll():
            outputs.setdefault(ids[out.request_id], []).extend(out.new_tokens)
        for i in range(int(s.sched[0].running)):
            slot = int(s.running[i])
            if s.seq_computed[slot] >= s.seq_prompt_len[slot]:
                s.prompts[slot] = rng.integers(0, VOCAB, s.prompts.shape[1])
                s.outputs[slot, :int(s.ngen[slot])] = rng.integers(0, VOCAB, int(s.ngen[slot]))
        if iteration > 3 and not agent.in_flight:
            break
    assert outputs == expected
    stats = agent.stats()
    assert stats["preempted"] == 0, "a preempted request re-prefills from the ring, which this test overwrites"
    assert stats["prefix_hit_tokens"] >= 16 and stats["spec_accepted_tokens"] > 0 and checked > 0, stats
