"""The agent's placement of grammars in the ring (nic/grammar_table.py): written once while in use, evicted least
recently used first and only when no request in flight uses them, free runs merged; RingFull while in-use grammars
leave no room, a RequestError for one that can never fit."""
import numpy as np
import pytest

from blink.errors import RequestError, RingFull
from blink.nic.grammar_table import GrammarTable
from blink.ring.geometry import RingGeometry
from blink.ring.grammar import PLACEMENT_WORDS, Grammar


def grammar(name: str, words: int) -> Grammar:
    """A grammar whose placement takes ``words`` words (its header included)."""
    return Grammar(("regex", name), 32, np.arange(words - PLACEMENT_WORDS, dtype=np.int32), np.array([0]), 0, 1)


def placement_id(region: np.ndarray, base: int) -> int:
    return int(region[base + 2].view(np.uint32)) << 32 | int(region[base + 1].view(np.uint32))


def table(words: int, part: range | None = None):
    region = np.zeros(words, np.int32)
    writes = []

    def write(word, data):
        writes.append(word)
        region[word:word + len(data) // 4] = np.frombuffer(data, "<i4")

    return GrammarTable(RingGeometry(max_grammar_bytes=4 * words, vocab_size=32), write, part), region, writes


def test_a_grammar_is_written_once_and_shared():
    t, region, writes = table(100)
    a = grammar("a", 10)
    assert t.acquire(a) == 0 and t.acquire(a) == 0 and writes == [0]
    records = region[PLACEMENT_WORDS:10].tolist()
    assert region[0] == 10 and records == [PLACEMENT_WORDS, *range(1, 10 - PLACEMENT_WORDS)]   # pointer word shifted
    t.release(a)
    t.release(a)
    assert t.acquire(grammar("b", 20)) == 10


def test_every_placement_has_an_id_of_its_own_even_at_a_word_used_before():
    """The GPU keeps its copy of a placement while the id at its first word matches: a grammar placed again where
    another was (by this table or a table before it over the same words) must carry another id."""
    ids = []
    for _ in range(2):                          # two tables (agents) over one region, one after the other
        t, region, _ = table(20)
        for name in ("a", "b", "a"):
            g = grammar(name, 20)
            assert t.acquire(g) == 0
            ids.append(placement_id(region, 0))
            t.release(g)
            t.acquire(grammar("evicts " + name, 20))    # evicts g, so the next acquire places a grammar again
            t.release(grammar("evicts " + name, 20))
    assert len(set(ids)) == len(ids) and 0 not in ids


def test_eviction_takes_unused_grammars_least_recently_used_first_and_merges_free_runs():
    t, _, _ = table(60)
    a, b, c = grammar("a", 20), grammar("b", 20), grammar("c", 20)
    for g in (a, b, c):
        t.acquire(g)
    t.release(a)
    t.release(c)
    t.acquire(a)                # a is used again: c is now the least recently used unused one
    t.release(a)
    with pytest.raises(RingFull):           # b is in use, a and c free together only 40 words, not contiguous
        t.acquire(grammar("d", 50))
    t.release(b)
    assert t.acquire(grammar("e", 60)) == 0     # every unused grammar evicted, their runs merged into one


def test_a_grammar_that_can_never_fit_is_a_request_error():
    t, _, _ = table(16)
    with pytest.raises(RequestError, match="more than this ring's grammars region"):
        t.check(grammar("big", 17))
    with pytest.raises(RequestError, match="compiled for 64 tokens"):
        t.check(Grammar(("regex", "v"), 64, np.zeros(4, np.int32), np.array([0]), 0, 1))


def test_an_agents_part_of_the_region_is_all_it_writes():
    """Where several agents serve one ring each places grammars in its own part of the region only."""
    t, region, writes = table(100, range(40, 70))
    a, b = grammar("a", 20), grammar("b", 10)
    assert t.acquire(a) == 40 and t.acquire(b) == 60 and writes == [40, 60]
    assert not region[:40].any() and not region[70:].any()
    with pytest.raises(RingFull):
        t.acquire(grammar("c", 1))
    with pytest.raises(RequestError, match="more than this agent's 120-byte part of this ring's grammars region of "
                                           "400"):
        t.check(grammar("big", 31))
