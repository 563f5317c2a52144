"""blink.nic.liveness: a long step is not a dead engine, a stopped loop or process is (reference: the rules stated
in the module docstring, applied to hand-written control-block snapshots and times)."""
import pytest

from blink.nic.liveness import TICK_FLOOR_S, Liveness
from blink.ring.control import ALIVE_TICK_S, ENGINE_SERVING, ENGINE_STOPPED


def snapshot(heartbeat=1, alive=0, in_step=0, step_limit_s=0, launch_error=0, engine_state=ENGINE_SERVING):
    return dict(heartbeat=heartbeat, alive=alive, in_step=in_step, step_limit_s=step_limit_s,
                launch_error=launch_error, engine_state=engine_state)


def test_a_long_step_on_the_host_is_not_an_alarm_until_its_limit():
    """Regression (false liveness alarms): a 12-40 s CPU prefill froze the heartbeat past the 10 s timeout and every
    request in flight failed with 503. Inside a step the limit is the backend's step_limit_s."""
    liveness = Liveness(timeout_s=10)
    assert liveness.problem(snapshot(heartbeat=5, in_step=1, step_limit_s=300), now=0.0) is None
    assert liveness.problem(snapshot(heartbeat=5, in_step=1, step_limit_s=300), now=299.0) is None
    assert "inside one model step" in liveness.problem(snapshot(heartbeat=5, in_step=1, step_limit_s=300), now=301.0)


def test_a_frozen_heartbeat_outside_a_step_is_an_alarm_after_the_timeout():
    liveness = Liveness(timeout_s=2)
    assert liveness.problem(snapshot(heartbeat=3), now=0.0) is None
    assert liveness.problem(snapshot(heartbeat=3), now=1.9) is None
    assert "stuck at 3 for 2.5 s" in liveness.problem(snapshot(heartbeat=3), now=2.5)
    assert liveness.problem(snapshot(heartbeat=4), now=2.6) is None          # it moved again


def test_an_engine_process_that_stops_ticking_is_gone_even_inside_a_step():
    liveness = Liveness(timeout_s=4 * ALIVE_TICK_S)
    for k in range(1, 9):       # ticking, inside a long step: fine
        assert liveness.problem(snapshot(alive=k, in_step=1, step_limit_s=600), now=k * ALIVE_TICK_S) is None
    assert not liveness.process_gone(now=8 * ALIVE_TICK_S)
    later = 8 * ALIVE_TICK_S + TICK_FLOOR_S + 0.01
    assert "has not ticked" in liveness.problem(snapshot(alive=8, in_step=1, step_limit_s=600), now=later)
    assert liveness.process_gone(now=later)


def test_a_tick_seconds_late_on_a_loaded_host_is_not_a_death():
    """Regression: with a 1 s timeout, an engine process whose ticking thread waited 1-3 s for a core or the GIL
    (2 cores at load 9-27) was declared gone, and every request in flight failed (the CPU soaks, and
    tests/host/test_process.py's long step once)."""
    liveness = Liveness(timeout_s=1.0)
    assert liveness.problem(snapshot(alive=1, in_step=1, step_limit_s=600), now=0.0) is None
    assert liveness.problem(snapshot(alive=1, in_step=2, step_limit_s=600), now=3.0) is None
    assert liveness.problem(snapshot(alive=2, in_step=3, step_limit_s=600), now=3.1) is None


def test_launch_errors_and_a_stopped_engine_are_reported_at_once():
    liveness = Liveness(timeout_s=10)
    assert "launch error 719" in liveness.problem(snapshot(launch_error=719), now=0.0)
    assert liveness.problem(snapshot(engine_state=ENGINE_STOPPED), now=0.0) == "the engine has stopped"


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        Liveness(timeout_s=0)
