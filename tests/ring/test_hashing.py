"""blink.ring.hashing: the agent's vectorised prompt keys equal the token-by-token definition; a key changes with
any token before its page's end, with its position and with the seed, and not with anything after it."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.ring.hashing import MASK64, prompt_keys, reference_keys, token_term


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=70), page_size=st.sampled_from([1, 3, 16]),
       seed=st.integers(0, 2**64 - 1))
def test_prompt_keys_equal_the_token_by_token_chain(tokens, page_size, seed):
    keys, state = prompt_keys(np.array(tokens, np.int32), page_size, seed)
    want_keys, want_state = reference_keys(tokens, page_size, seed)
    assert keys.dtype == np.uint64 and keys.tolist() == want_keys and state == want_state
    assert len(want_keys) == len(tokens) // page_size


def test_each_key_chains_the_previous_one_with_its_pages_tokens():
    tokens, page, seed = list(range(100, 112)), 4, 7
    keys, _ = reference_keys(tokens, page, seed)
    for j, key in enumerate(keys):
        previous = keys[j - 1] if j else 0
        terms = sum(token_term(tokens[p], p, seed) for p in range(j * page, (j + 1) * page))
        assert key == (previous + terms) & MASK64


def test_a_key_names_its_whole_prefix_and_nothing_after_it():
    tokens, page, seed = list(range(1, 13)), 4, 99
    keys, _ = reference_keys(tokens, page, seed)
    changed_early = reference_keys([tokens[0] + 1] + tokens[1:], page, seed)[0]
    assert all(a != b for a, b in zip(keys, changed_early)), "a first-page token reaches every later key"
    changed_late = reference_keys(tokens[:8] + [0] * 4, page, seed)[0]
    assert changed_late[:2] == keys[:2] and changed_late[2] != keys[2]
    swapped = reference_keys([tokens[1], tokens[0]] + tokens[2:], page, seed)[0]
    assert swapped[0] != keys[0], "positions count, not only the multiset of tokens"
    assert reference_keys(tokens, page, seed + 1)[0][0] != keys[0]
