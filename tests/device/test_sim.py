"""The CPU scheduler loop (``blink.device.sim.SimScheduler``): the liveness signals it writes around host work, read
by the agent's real ``Liveness`` at chosen moments of the loop (a test clock, so "long" costs no time), and its idle
loop (quiescent: a beat instead of a simulated iteration; reference: the arrays a real idle iteration leaves)."""
import threading
import time

import numpy as np

from blink.device.config import SchedulerConfig
from blink.device.sim import SimScheduler
from blink.device.state import IDLE
from blink.device.step import StepBuffers, StepLayout
from blink.nic.agent import Agent
from blink.nic.liveness import Liveness
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.request import SamplingParams
from blink.ring.standin import standin_step
from blink.ring.transport import LocalMemory

GEOMETRY = RingGeometry(n_slots=4, max_prompt_tokens=16, max_output_tokens=4, max_stop_ids=1, prefix_page_size=4)
CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=4, num_pages=16, max_model_len=20,
                         buckets=(4, 16), eos_token_ids=(), block_threads=2)
TIMEOUT_S, STEP_LIMIT_S = 10.0, 100


def ring(step_fn=standin_step):
    layout = RingLayout(GEOMETRY)
    memory = LocalMemory(layout.size)
    memory.write(0, layout.control_bytes())
    control.write(memory, "step_limit_s", STEP_LIMIT_S)
    step = StepBuffers(StepLayout(CONFIG.buckets[-1], CONFIG.max_num_seqs, CONFIG.max_pages_per_seq))
    scheduler = SimScheduler(layout.view(memory.buffer), GEOMETRY, CONFIG, step, step_fn=step_fn, threads=2)
    return memory, Agent(memory, GEOMETRY), scheduler


def test_the_end_of_a_long_step_is_a_beat():
    """Regression (issue 38, item 3: 7 % of the soak's requests failed with 503): the heartbeat moves when an
    iteration begins, so between a long step's end and the next iteration a reader saw a heartbeat that had stood
    still for the whole step, outside a step, and declared the engine dead. The step's end is a beat now."""
    liveness, now = Liveness(TIMEOUT_S), [0.0]

    def long_step(arrays, bucket_tokens):
        assert liveness.problem(control.read(memory), now[0]) is None
        now[0] += 3 * TIMEOUT_S                         # a step three liveness timeouts long
        assert liveness.problem(control.read(memory), now[0]) is None, "inside the step: its limit applies"
        standin_step(arrays, bucket_tokens)

    memory, agent, scheduler = ring(long_step)
    agent.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert scheduler.iteration() >= 0, "the step ran"
    now[0] += 0.5       # the step has ended, the next iteration has not begun: its heartbeat has not moved
    assert control.read(memory)["in_step"] == 0
    assert liveness.problem(control.read(memory), now[0]) is None
    # A loop that does not go on after the step is still found out, one timeout after the step's end.
    assert "stuck" in liveness.problem(control.read(memory), now[0] + TIMEOUT_S + 1)


def test_a_step_that_keeps_progressing_is_alive_however_long_it_takes():
    """Regression (issue 38, item 4: a legal 2,048-token prefill on a loaded host outlasted the derived step limit,
    and everything in flight got 503, forever, as clients retried). Each layer is a beat (``progress``): a step
    five step limits long that moves is alive; one that stands still for a step limit is hung."""
    liveness, now = Liveness(TIMEOUT_S), [0.0]

    def layered_step(arrays, bucket_tokens):
        for _ in range(50):                             # 50 "layers" of 0.1 step limit each
            now[0] += 0.1 * STEP_LIMIT_S
            scheduler.progress()
            assert liveness.problem(control.read(memory), now[0]) is None
        now[0] += STEP_LIMIT_S + 1                      # then one that never ends
        assert "inside one model step" in liveness.problem(control.read(memory), now[0])
        standin_step(arrays, bucket_tokens)

    memory, agent, scheduler = ring(layered_step)
    agent.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert scheduler.iteration() >= 0


def arrays_of(scheduler) -> dict[str, np.ndarray]:
    return {name: np.array(value, copy=True) for name, value in scheduler.arrays._asdict().items()
            if isinstance(value, np.ndarray)}


def moved_fields(before: np.ndarray, after: np.ndarray) -> set[str]:
    """The fields of a one-element record array that differ between two copies of it."""
    return {name for name in before.dtype.names if not np.array_equal(before[name], after[name])}


def test_an_idle_iteration_of_a_quiescent_scheduler_changes_only_its_heartbeat():
    """What lets the idle loop beat instead of iterating: once two idle iterations saw the same doorbells, a real
    third one changes nothing but the heartbeat and its own profile (and ``_idle_beat`` does just that)."""
    memory, agent, scheduler = ring()
    agent.submit([1, 2, 3], SamplingParams(max_tokens=3))
    while scheduler.iteration() != IDLE or agent.in_flight:
        agent.poll()
    assert scheduler.iteration() == IDLE and scheduler.iteration() == IDLE
    before = arrays_of(scheduler)
    assert scheduler.iteration() == IDLE
    after = arrays_of(scheduler)
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert changed <= {"stats", "control"}, changed
    assert moved_fields(before["stats"], after["stats"]) - {"profile"} == {"heartbeat"}
    assert moved_fields(before["control"], after["control"]) == {"heartbeat"}
    scheduler._idle_beat()
    beaten = arrays_of(scheduler)
    assert int(beaten["control"][0].heartbeat) == int(after["control"][0].heartbeat) + 1
    assert all(np.array_equal(after[name], beaten[name]) for name in after if name not in ("stats", "control"))


def test_an_idle_loop_costs_next_to_nothing_and_wakes_for_a_request():
    """Regression (issue 38, item 10: an idle CPU engine used 16-28 % of a core simulating empty iterations). Idle,
    the loop beats (the agent's liveness sees the heartbeat move) and a submission wakes it at once."""
    memory, agent, scheduler = ring()
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        time.sleep(1.0)                                 # settle into the quiescent loop
        beat, wall, cpu = control.read(memory)["heartbeat"], time.monotonic(), time.process_time()
        time.sleep(3.0)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
        assert control.read(memory)["heartbeat"] > beat, "an idle loop still beats"
        assert used < 0.05, f"the idle loop used {used:.0%} of a core"
        request = agent.submit([1, 2, 3], SamplingParams(max_tokens=2))
        deadline, finished = time.monotonic() + 60, False
        while not finished and time.monotonic() < deadline:
            finished = any(out.request_id == request and out.finished for out in agent.poll())
            time.sleep(0.01)
        assert finished, "the idle loop did not wake for a request"
    finally:
        control.request_shutdown(memory)
        loop.join(60)
