"""blink.ring.shares: the shares of N agents tile the ring's slots and grammars region, and the doorbell contract
holds: no value is ever written twice, whatever the agents' interleaving and restarts, so the GPU scheduler (the
real device code, simulated: ``blink.device.sim``), which acts on a doorbell that differs from the value it last
acted on, misses no submission; agents that broke the contract (each counting from the word alone) leave it at a
value it acted on, and a request is never admitted."""
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blink.device.state import IDLE
from blink.nic.agent import Agent
from blink.ring import control
from blink.ring.shares import RESTART_STRIDE, Share
from blink.ring.request import SamplingParams
from tests.device.test_sim import GEOMETRY, ring


@given(n=st.integers(1, 5000), agents=st.integers(1, 64))
def test_the_shares_tile_the_slots_and_the_grammars_region(n, agents):
    if n < agents:
        with pytest.raises(ValueError, match=f"{agents} agents need a ring of at least {agents} slots"):
            Share(0, agents).slots(n)
        return
    for part in (Share.slots, Share.words):
        ranges = [part(Share(i, agents), n) for i in range(agents)]
        assert [s for r in ranges for s in r] == list(range(n)), "contiguous, disjoint, in order, covering"
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
        assert part is Share.words or min(map(len, ranges)) >= 1


@pytest.mark.parametrize("fields,message", [((2, 2), "index must be below"), ((0, 0), "agents must be"),
                                            ((-1, 2), "index must be"), ((0, 1, True), "restarts must be")])
def test_a_bad_share_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Share(*fields)


def test_per_process_caps_round_up():
    assert [Share(0, n).cap(1024) for n in (1, 2, 3)] == [1024, 512, 342]
    assert Share(0, 4).cap(1) == 1 and Share(0, 4).cap(0) == 0


@settings(max_examples=1000)
@given(agents=st.integers(1, 8), schedule=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), max_size=200))
# Agent 1's first restart continued from agent 2's second restart's word, into the range its own second restart
# then counted in (found by this test in CI, when Share.first_count took the word's count whatever its range).
@example(agents=3, schedule=[(2, 0), (2, 0), (2, 1), (1, 0), (1, 1), (0, 1), (1, 0), (1, 1), (1, 1)])
def test_no_doorbell_value_is_written_twice(agents, schedule):
    """Agents write in any order, and die and are restarted (each restart continuing from the word it finds):
    every value the word ever holds is new, and with one agent the word counts its writes."""
    word, written = 0, []
    restarts = [0] * agents
    counts = [Share(i, agents).first_count(word) for i in range(agents)]
    for who, action in schedule:
        i = who % agents
        if action == 0:             # agent i dies and its successor attaches
            restarts[i] += 1
            counts[i] = Share(i, agents, restarts[i]).first_count(word)
        else:
            counts[i] += 1
            word = Share(i, agents, restarts[i]).doorbell(counts[i])
            written.append(word)
    assert len(set(written)) == len(written)
    if agents == 1 and not any(restarts):
        assert written == list(range(1, len(written) + 1))


def test_a_restarted_agent_writes_above_everything_its_predecessor_wrote():
    old = Share(1, 2)
    last = old.doorbell(old.first_count(0) + 10_000)
    new = Share(1, 2, restarts=1)
    assert new.doorbell(new.first_count(word=3)) > last and new.first_count(0) == RESTART_STRIDE


def submissions_seen(shares) -> tuple[int, bool]:
    """Two agents of ``shares`` on one ring, submitting in turn between iterations of the real (simulated) GPU
    scheduler: how many submissions left the doorbell at a value the scheduler had acted on, and whether every
    request was answered in full (its two tokens, finish reason "length")."""
    memory, _, scheduler = ring()
    agents = [Agent(memory, GEOMETRY, share=share) for share in shares]
    acted, clashes, answers = set(), 0, {}

    def poll():
        for k, agent in enumerate(agents):
            for out in agent.poll():
                tokens, _ = answers[k, out.request_id]
                answers[k, out.request_id] = (tokens + len(out.new_tokens), out.finish_reason)

    for turn in range(4):
        k = turn % 2
        answers[k, agents[k].submit([1, 2, 3 + turn], SamplingParams(max_tokens=2, ignore_eos=True))] = (0, None)
        clashes += control.read(memory)["submitted"] in acted
        scheduler.iteration()
        acted.add(int(scheduler.arrays.stats[0].seen_submitted))
        poll()
    for _ in range(40):
        if scheduler.iteration() == IDLE and not any(agent.in_flight for agent in agents):
            break
        poll()
    return clashes, set(answers.values()) == {(2, "length")}


def test_two_agents_interleaving_submissions_never_leave_the_doorbell_at_a_value_the_gpu_acted_on():
    clashes, answered = submissions_seen([Share(0, 2), Share(1, 2)])
    assert clashes == 0 and answered
    # The contract is what makes it so: two agents that each count from the word (two lone agents' rule) write the
    # value the other wrote, the scheduler takes nothing new, and requests are never admitted.
    clashes, answered = submissions_seen([Share(), Share()])
    assert clashes > 0 and not answered
