"""blink.bench.datasets: the ShareGPT loader on a hand-made ShareGPT_V3-format file (tokenized by whitespace, so the
lengths can be counted by eye), and the synthetic generator's determinism and length distribution."""
import random
from pathlib import Path

import numpy as np
import pytest

from blink.bench.datasets import MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN, sharegpt, synthetic

FIXTURE = str(Path(__file__).with_name("sharegpt_tiny.json"))
WORDS = {}


def encode(text: str) -> list[int]:
    """One token per whitespace-separated word; ids stable across calls."""
    return [WORDS.setdefault(word, len(WORDS)) for word in text.split()]


# The fixture's usable conversations (>= 2 turns, >= 4 prompt and output words): (prompt words, answer words).
USABLE = {"a": (5, 4), "e": (6, 6), "g": (8, 8)}
# "d" has a 2-word answer: usable only when the output length is fixed.


def test_sharegpt_keeps_first_two_turns_that_pass_the_filter():
    requests = sharegpt(FIXTURE, encode, num_prompts=3, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == sorted(USABLE.values())
    for r in requests:
        assert len(r.prompt) == r.prompt_len


def test_sharegpt_order_is_vllms_seeded_shuffle():
    # vLLM: random.seed(seed); random.shuffle(conversations with >= 2 turns); take valid ones in order.
    with_two_turns = ["a", "c", "d", "e", "g"]
    for seed in (0, 1, 2):
        order = list(with_two_turns)
        random.Random(seed).shuffle(order)
        expected = [USABLE[k] for k in order if k in USABLE][:2]
        got = [(r.prompt_len, r.output_len) for r in sharegpt(FIXTURE, encode, num_prompts=2, seed=seed)]
        assert got == expected


def test_sharegpt_fixed_output_len_admits_short_answers():
    requests = sharegpt(FIXTURE, encode, num_prompts=4, seed=0, output_len=7)
    assert sorted(r.prompt_len for r in requests) == [5, 6, 6, 8]       # "d" (6 words, 2-word answer) too
    assert {r.output_len for r in requests} == {7}


def test_sharegpt_with_too_few_conversations_says_how_many():
    with pytest.raises(ValueError, match="has only 3 usable conversations.*--num-prompts asks for 4"):
        sharegpt(FIXTURE, encode, num_prompts=4, seed=0)


def test_sharegpt_rejects_a_file_of_another_format(tmp_path):
    path = tmp_path / "not_sharegpt.json"
    path.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="has only 0 usable conversations"):
        sharegpt(str(path), encode, num_prompts=1)


def test_synthetic_is_deterministic_and_a_smaller_set_is_a_prefix():
    big = synthetic(50, vocab_size=1000, seed=7)
    assert synthetic(50, vocab_size=1000, seed=7) == big
    assert synthetic(5, vocab_size=1000, seed=7) == big[:5]
    assert synthetic(50, vocab_size=1000, seed=8) != big


def test_synthetic_lengths_are_sharegpt_like_and_filtered():
    requests = synthetic(3000, vocab_size=32000, seed=0)
    prompt = np.array([r.prompt_len for r in requests])
    output = np.array([r.output_len for r in requests])
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert all(0 <= t < 32000 for r in requests[:100] for t in r.prompt)
    assert prompt.min() >= MIN_LEN and output.min() >= MIN_LEN and prompt.max() <= MAX_PROMPT_LEN
    assert (prompt + output).max() <= MAX_TOTAL_LEN
    # vLLM's ShareGPT_V3 sample averages 215 prompt and ~200 output tokens; medians are well below the means.
    assert 195 < prompt.mean() < 235 and 180 < output.mean() < 220
    assert 140 < np.median(prompt) < 172 and 123 < np.median(output) < 151
    assert np.percentile(prompt, 99) > 700 and np.percentile(output, 99) > 700      # the long tail


def test_synthetic_fixed_output_len():
    requests = synthetic(20, vocab_size=100, seed=0, output_len=128)
    assert {r.output_len for r in requests} == {128}
    with pytest.raises(ValueError, match=r"vocab_size, output_len and input_len must be >= 1 \(got 0,"):
        synthetic(1, vocab_size=0)


def test_synthetic_fixed_input_len_draws_only_the_outputs():
    """``--input-len`` (vLLM's --random-input-len): every prompt has that many tokens; outputs are still drawn,
    ShareGPT-like and filtered; a smaller set is still a prefix of a larger one."""
    requests = synthetic(400, vocab_size=1000, seed=1, input_len=100)
    assert all(r.prompt_len == len(r.prompt) == 100 for r in requests)
    output = np.array([r.output_len for r in requests])
    assert output.min() >= MIN_LEN and 160 < output.mean() < 240 and len(set(output)) > 100
    assert synthetic(7, vocab_size=1000, seed=1, input_len=100) == requests[:7]
    with pytest.raises(ValueError, match="input_len must be >= 1"):
        synthetic(1, vocab_size=10, input_len=0)


def test_fixed_lengths_beyond_sharegpts_bounds_are_taken_as_given():
    """A fixed output of 2048 tokens or more passed no drawn prompt through the total bound: the set never ended."""
    assert {(r.prompt_len, r.output_len) for r in synthetic(3, vocab_size=50, input_len=3000, output_len=4096)} == \
        {(3000, 4096)}
    requests = synthetic(20, vocab_size=50, seed=2, output_len=4096)
    assert {r.output_len for r in requests} == {4096}
    assert all(MIN_LEN <= r.prompt_len <= MAX_PROMPT_LEN for r in requests)


def test_shared_prefix_requests_begin_with_one_system_prompt_and_are_deterministic():
    from blink.bench.datasets import MAX_TURN_LEN, shared_prefix

    requests = shared_prefix(20, vocab_size=1000, seed=3, prefix_len=64)
    system = requests[0].prompt[:64]
    assert all(r.prompt[:64] == system and len(r.prompt) == r.prompt_len for r in requests)
    assert all(MIN_LEN <= r.prompt_len - 64 <= MAX_TURN_LEN and MIN_LEN <= r.output_len <= MAX_TURN_LEN
               for r in requests)
    assert len({tuple(r.prompt[64:]) for r in requests}) == 20, "every user turn its own"
    assert shared_prefix(20, vocab_size=1000, seed=3, prefix_len=64) == requests
    assert shared_prefix(20, vocab_size=1000, seed=4, prefix_len=64) != requests


def test_multi_turn_conversations_resend_their_history():
    from blink.bench.datasets import shared_prefix

    requests = shared_prefix(7, vocab_size=1000, seed=0, output_len=5, prefix_len=16, turns=3)
    assert len(requests) == 7
    first, second, third = requests[0:3], requests[3:6], requests[6:]       # 3 conversations, turn by turn
    for earlier, later in zip(first + second, second + third):
        n = earlier.prompt_len
        assert later.prompt[:n] == earlier.prompt, "a turn resends the turn before it"
        assert later.prompt_len > n + earlier.output_len, "its answer (output_len tokens) and a new user turn"
    assert {r.output_len for r in requests} == {5}
