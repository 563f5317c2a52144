import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blink.errors import RingFull
from blink.nic.slots import SlotTracker
from blink.ring.layout import FINISHED, FREE, READY, RUNNING


def reference_scan(free: set[int], hint: int, first: int, n: int) -> int:
    """First free slot at or after ``first + hint``, circularly over ``[first, first + n)``."""
    return min(free, key=lambda s: (s - first - hint) % n)


class TrackerVersusRing(RuleBasedStateMachine):
    """Random interleavings of the agent's and the GPU's transitions on a simulated ring.

    The ring may start with slots another writer left in use. The tracker hands out a range of the ring's slots
    (its agent's share; the whole ring, or a part while other agents change the other slots). The model keeps its
    own idea of the tracker's cache (free slots) and hint, and checks that every claim returns exactly the slot the
    hinted circular scan over the range must find.
    """

    @initialize(n=st.integers(1, 24), data=st.data())
    def setup(self, n, data):
        first = data.draw(st.integers(0, n - 1))
        self.mine = range(first, data.draw(st.integers(first + 1, n)))
        self.n, self.first = len(self.mine), first
        self.ring = np.array(data.draw(st.lists(st.sampled_from([FREE, FREE, FREE, RUNNING, FINISHED]),
                                                min_size=n, max_size=n)), dtype=np.uint32)
        self.tracker = SlotTracker(n, self.mine)
        self.tracker.refresh(self.ring)
        self.free = {s for s in self.mine if self.ring[s] == FREE}
        self.hint = 0
        self.held: dict[int, int] = {}          # slot -> request number
        self.submitted = 0
        self.released: list[int] = []
        self.claims = 0
        self.expected_probes = 0

    @rule()
    def submit(self):
        if not self.free:
            with pytest.raises(RingFull):
                self.tracker.claim()
            return
        want = reference_scan(self.free, self.hint, self.first, self.n)
        slot = self.tracker.claim()
        assert slot == want and slot in self.mine
        assert self.ring[slot] == FREE and slot not in self.held, "handed out a slot that is in use"
        self.expected_probes += (slot - self.first - self.hint) % self.n
        self.claims += 1
        self.hint = (slot - self.first + 1) % self.n
        self.free.discard(slot)
        self.ring[slot] = READY
        self.held[slot] = self.submitted
        self.submitted += 1

    def _held_in(self, *states):
        return sorted(s for s in self.held if self.ring[s] in states)

    @precondition(lambda self: any(self.ring[s] == READY for s in self.held))
    @rule(data=st.data())
    def gpu_admits(self, data):
        self.ring[data.draw(st.sampled_from(self._held_in(READY)))] = RUNNING

    @precondition(lambda self: any(self.ring[s] in (READY, RUNNING) for s in self.held))
    @rule(data=st.data())
    def gpu_finishes_or_cancels(self, data):
        self.ring[data.draw(st.sampled_from(self._held_in(READY, RUNNING)))] = FINISHED

    @precondition(lambda self: any(self.ring[s] == FINISHED for s in self.held))
    @rule(data=st.data())
    def agent_releases(self, data):
        slot = data.draw(st.sampled_from(self._held_in(FINISHED)))
        self.ring[slot] = FREE
        self.tracker.release(slot)
        self.released.append(self.held.pop(slot))
        self.free.add(slot)

    @precondition(lambda self: len(self.mine) < len(self.ring))
    @rule(data=st.data())
    def another_agent_moves_one_of_its_slots(self, data):
        slot = data.draw(st.sampled_from([s for s in range(len(self.ring)) if s not in self.mine]))
        self.ring[slot] = data.draw(st.sampled_from([FREE, READY, RUNNING, FINISHED]))

    @rule()
    def refresh(self):
        self.tracker.refresh(self.ring)
        self.free = {s for s in self.mine if self.ring[s] == FREE and s not in self.held}

    @invariant()
    def cache_matches_model(self):
        if not hasattr(self, "tracker"):
            return
        assert self.tracker.n_free == len(self.free)
        assert all(self.tracker.is_held(s) == (s in self.held) for s in self.mine)
        assert self.tracker.probes == self.expected_probes

    @invariant()
    def no_request_lost_or_duplicated(self):
        if not hasattr(self, "tracker"):
            return
        assert sorted(self.released + list(self.held.values())) == list(range(self.submitted))
        assert len(set(self.held)) == len(self.held)

    def teardown(self):
        if not hasattr(self, "tracker"):
            return
        # Drain: finish and release everything; no slot may leak.
        for slot in list(self.held):
            self.ring[slot] = FREE
            self.tracker.release(slot)
        self.tracker.refresh(self.ring)
        assert self.tracker.n_free == int(np.count_nonzero(self.ring[self.mine.start:self.mine.stop] == FREE))


TestTrackerVersusRing = TrackerVersusRing.TestCase
TestTrackerVersusRing.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@given(n=st.integers(1, 300), rounds=st.integers(1, 5))
def test_fifo_completion_scans_nothing(n, rounds):
    """When requests finish in arrival order the slot at the hint is always free: zero probes per claim."""
    tracker = SlotTracker(n)
    window = []
    for _ in range(rounds * n):
        if tracker.n_free == 0:
            tracker.release(window.pop(0))
        window.append(tracker.claim())
    assert tracker.probes == 0


def test_release_of_a_slot_not_held_is_refused():
    tracker = SlotTracker(4)
    with pytest.raises(ValueError, match="not held"):
        tracker.release(2)
    slot = tracker.claim()
    tracker.release(slot)
    with pytest.raises(ValueError, match="not held"):
        tracker.release(slot)


def test_refresh_never_frees_a_held_slot_and_checks_shape():
    tracker = SlotTracker(3)
    slot = tracker.claim()
    tracker.refresh(np.zeros(3, np.uint32))          # the ring still says FREE: the agent has not published yet
    assert tracker.is_held(slot) and tracker.n_free == 2
    assert tracker.claim() != slot and tracker.claim() != slot
    with pytest.raises(RingFull, match="all 3 request slots"):
        tracker.claim()
    with pytest.raises(ValueError, match="3 state words"):
        tracker.refresh(np.zeros(4, np.uint32))


def test_a_slot_outside_the_trackers_range_is_neither_held_nor_released():
    tracker = SlotTracker(6, range(2, 4))
    assert [tracker.claim(), tracker.claim()] == [2, 3]
    for call in (tracker.release, tracker.hold, tracker.is_held):
        with pytest.raises(ValueError, match="not among this tracker's slots 2-3"):
            call(4)
    with pytest.raises(ValueError, match="a non-empty range of consecutive slots of the ring's 6"):
        SlotTracker(6, range(4, 7))


def test_a_held_slot_the_ring_shows_in_use_is_released_like_a_claimed_one():
    tracker = SlotTracker(4, range(2, 4))
    tracker.refresh(np.array([FREE, FREE, RUNNING, FREE], np.uint32))
    tracker.hold(2)
    assert tracker.is_held(2) and tracker.n_free == 1
    with pytest.raises(ValueError, match="held by this tracker already"):
        tracker.hold(2)
    tracker.release(2)
    assert tracker.n_free == 2
