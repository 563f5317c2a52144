"""Whether the engine on the other side of the ring is alive, judged from the control-block words the agent reads.

Three signals, each written by the engine side:

- ``heartbeat``: +1 per scheduler iteration, idle or not: the loop makes progress;
- ``in_step``: nonzero while the loop does host work (the CPU backend: a simulated iteration and its model step; a
  2,048-token prefill can take minutes on a loaded host, during which no iteration ends); it moves as that work
  progresses (+1 per model layer) and drops to 0 at its end; ``step_limit_s`` bounds how long it may stand still;
- ``alive``: +1 every ``ALIVE_TICK_S`` from the engine process itself (``blink.host.process.serve_ring``); 0 when
  nothing ticks it (an engine inside the agent's own process).

A beat is any change of the pair (``heartbeat``, ``in_step``): an iteration, a layer of a step, a step's end. The
engine is dead when it reported a launch error, stopped, its process stopped ticking ``alive`` for ``timeout_s``
(at least ``TICK_FLOOR_S``),
or it has not beaten for ``timeout_s`` outside a step (or for ``step_limit_s`` inside one). A long step that keeps
moving is therefore never an alarm, however long it takes; a step stuck in one place for ``step_limit_s`` and a
dead loop still are. The step's end counts as a beat because the heartbeat moves only when the next iteration
begins: a reader between the two would otherwise see a heartbeat that stood still for the whole step, outside a
step.
"""
from __future__ import annotations

from blink.ring.control import ENGINE_STOPPED

# The process tick comes from a Python thread of the engine's process, which waits for a core and for the GIL the
# model step shares: on a loaded host it was late by over a second (2 cores at load 9-27), and a 1 s timeout then
# failed everything in flight. A dead process inside a long step is still found within TICK_FLOOR_S (outside a step
# the heartbeat finds it within the timeout).
TICK_FLOOR_S = 5.0


class Liveness:
    """Folds successive control-block snapshots into "alive" or the reason it is not. Times are the caller's
    monotonic clock in seconds."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"the liveness timeout must be > 0 seconds (got {timeout_s!r})")
        self._tick_timeout_s = max(timeout_s, TICK_FLOOR_S)
        self.timeout_s = timeout_s
        self._beat = self._alive = None             # the last (heartbeat, in_step) and alive seen
        self._beat_at = self._alive_at = None

    def problem(self, control, now: float) -> str | None:
        """Why the engine counts as dead given this snapshot (``control[name]`` for every control word), or None."""
        if int(control["launch_error"]):
            return f"the GPU loop reported device graph launch error {int(control['launch_error'])}"
        if int(control["engine_state"]) == ENGINE_STOPPED:
            return "the engine has stopped"
        heartbeat, in_step, alive = int(control["heartbeat"]), int(control["in_step"]), int(control["alive"])
        if (heartbeat, in_step) != self._beat or self._beat_at is None:
            self._beat, self._beat_at = (heartbeat, in_step), now
        if alive != self._alive or self._alive_at is None:
            self._alive, self._alive_at = alive, now
        if self.process_gone(now):
            return f"the engine process has not ticked for {now - self._alive_at:.1f} s: it is gone or stopped"
        still = now - self._beat_at
        limit = max(self.timeout_s, int(control["step_limit_s"])) if in_step else self.timeout_s
        if still > limit:
            where = " inside one model step" if in_step else ""
            return (f"the engine's heartbeat has been stuck at {heartbeat} for {still:.1f} s{where}: the scheduler "
                    "loop (or consumer process) is not running")
        return None

    def process_gone(self, now: float) -> bool:
        """The engine process ticked ``alive`` and then stopped for ``timeout_s`` (at least ``TICK_FLOOR_S``): it
        exited or was stopped."""
        return bool(self._alive) and now - self._alive_at > self._tick_timeout_s
