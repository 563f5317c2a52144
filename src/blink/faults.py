"""Faults injected into the CPU engine's model steps, for tests: steps made long on purpose, and an engine that dies
inside a step. Read from the environment, so that they reach an engine in a process of its own (``blink serve``
spawns it); never set them in production.

- ``BLINK_TEST_SLOW_STEPS=K:S``: every K-th model step first sleeps S seconds (without a progress beat: a step
  stuck in one place that long, as on a host whose CPU is taken by others);
- ``BLINK_TEST_FAIL_STEP=N``: the N-th model step raises ``InjectedFault``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

SLOW_STEPS, FAIL_STEP = "BLINK_TEST_SLOW_STEPS", "BLINK_TEST_FAIL_STEP"


class InjectedFault(RuntimeError):
    """The failure ``BLINK_TEST_FAIL_STEP`` asked for."""


@dataclass(frozen=True)
class StepFaults:
    """``slow_every``: every this many steps one sleeps ``slow_s`` (0: none); ``fail_at``: the step that raises
    (0: none). Steps count from 1."""

    slow_every: int = 0
    slow_s: float = 0.0
    fail_at: int = 0

    def __post_init__(self):
        if self.slow_every < 0 or self.fail_at < 0 or not 0 <= self.slow_s < 3600:
            raise ValueError(f"bad step faults {self}: counts must be >= 0 and the sleep in [0, 3600) seconds")

    @classmethod
    def from_env(cls, env=os.environ) -> StepFaults:
        """The faults the environment asks for (none when neither variable is set)."""
        try:
            every, _, seconds = env.get(SLOW_STEPS, "0:0").partition(":")
            return cls(int(every), float(seconds or 0), int(env.get(FAIL_STEP, "0")))
        except ValueError as e:
            raise ValueError(f"{SLOW_STEPS} must be K:SECONDS and {FAIL_STEP} a step number ({e})") from None

    def before(self, step: int) -> None:
        """Apply the faults of step number ``step`` (from 1), before it runs."""
        if step == self.fail_at:
            raise InjectedFault(f"fault injected in model step {step} ({FAIL_STEP})")
        if self.slow_every and step % self.slow_every == 0:
            time.sleep(self.slow_s)
