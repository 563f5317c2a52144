"""Reference consumer: the GPU side of the ring played in pure Python, with the stand-in model.

This is the executable specification of what the agent may observe. The GPU scheduler (and its simulator run) must
produce the same outputs for the same ring contents; only timing may differ. Per iteration (``step``):

1. heartbeat += 1; every slot this consumer runs must still be RUNNING with its epoch, else ``IllegalTransition``;
2. cancels: a READY or RUNNING slot whose ``cancel`` word equals its epoch finishes with reason "abort";
3. admission: READY slots in arrival order (``arrival_ns``, then slot index) while fewer than ``max_running`` run;
   a request whose header breaks the geometry (empty or oversize prompt, bad max_tokens), or that follows a grammar
   (the stand-in model serves none), finishes with "error";
4. generation: each running request gets its next stand-in token (and logprob when asked): token, then
   ``n_generated``; then the stop checks, in this order: an EOS id (unless ignore_eos) or a stop id -> "stop";
   ``n_generated == max_tokens`` -> "length". Stop tokens are part of the output.

``run()`` loops until the control block's shutdown flag is set, then aborts everything in flight and marks the engine
stopped.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import time
import uuid
from contextlib import contextmanager

import numpy as np

from blink.ring import control
from blink.ring.control import CONTROL_DTYPE, ENGINE_SERVING, ENGINE_STOPPED
from blink.ring.errors import EngineUnresponsive, IllegalTransition
from blink.ring.geometry import RingGeometry
from blink.ring.layout import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_NAMES, FINISH_NONE, FINISH_STOP,
                               FINISHED, FLAG_GRAMMAR, FLAG_IGNORE_EOS, FLAG_LOGPROBS, GPU, READY, RUNNING, STATE_NAMES,
                               RingLayout, RingView, check_transition)
from blink.ring.standin import STANDIN_VOCAB, standin_continuation, standin_logprob, standin_token

_standin_numbers = itertools.count()
STANDIN_START_S = 120.0     # a spawned Python importing numpy and blink.ring: seconds on a busy 2-core box
log = logging.getLogger("blink")


def stop_reason(token: int, n_generated: int, header, stop_token_ids, eos_token_ids: frozenset[int]) -> int:
    """Why a request ends after emitting ``token`` as its ``n_generated``-th token (``FINISH_NONE``: it goes on);
    ``header`` has the fields of ``HEADER_DTYPE`` that decide it, ``stop_token_ids`` the request's row of them."""
    if token in eos_token_ids and not int(header["request_flags"]) & FLAG_IGNORE_EOS:
        return FINISH_STOP
    if token in stop_token_ids[:int(header["n_stop"])]:
        return FINISH_STOP
    if n_generated >= int(header["max_tokens"]):
        return FINISH_LENGTH
    return FINISH_NONE


def expected_output(prompt: list[int], params, eos_token_ids=(), vocab_size: int = STANDIN_VOCAB,
                    ) -> tuple[list[int], str]:
    """What this consumer answers to one request (``SamplingParams`` with a seed): tokens and finish reason."""
    header = {"request_flags": FLAG_IGNORE_EOS if params.ignore_eos else 0, "n_stop": len(params.stop_token_ids),
              "max_tokens": params.max_tokens}
    tokens = standin_continuation(prompt, params.seed, params.max_tokens, vocab_size)
    for n, token in enumerate(tokens, 1):
        reason = stop_reason(token, n, header, list(params.stop_token_ids), frozenset(eos_token_ids))
        if reason != FINISH_NONE:
            return tokens[:n], FINISH_NAMES[reason]
    raise AssertionError("unreachable: max_tokens always ends a request")


class ReferenceConsumer:
    """``step_s``: the least time between two steps that generate, as a GPU's decode step takes it (0: as fast as
    Python goes). Benchmarks of the agent pace the stand-in so that every poll finds about one token per stream, as
    it does behind a real engine; outputs never depend on it."""

    def __init__(self, view: RingView, *, eos_token_ids=(), max_running: int = 256,
                 vocab_size: int = STANDIN_VOCAB, step_s: float = 0.0):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1 (got {max_running})")
        self.step_s = check_step_s(step_s)
        self.view = view
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._eos_array = np.array(sorted(self.eos_token_ids), np.uint64)
        self.max_running = max_running
        self.vocab_size = vocab_size
        self._running: dict[int, int] = {}      # slot -> epoch, in admission order
        self._ctl = view.control[0]

    def step(self) -> int:
        """One iteration; returns the number of tokens generated (0 when idle)."""
        self._ctl["heartbeat"] += 1
        self._check_owned()
        self._honour_cancels()
        self._admit()
        generated = self._generate()
        if generated:
            self._ctl["steps"] += 1
            self._ctl["tokens"] += generated
        self._ctl["running"] = len(self._running)
        self._ctl["waiting"] = int(np.count_nonzero(self.view.status["state"] == READY))
        return generated

    def run(self, idle_sleep_s: float = 50e-6, orphaned=lambda: False) -> None:
        """Serve until shutdown is requested (or ``orphaned()`` says nobody is left to ask); then abort what is in
        flight and report the engine stopped."""
        self._ctl["engine_state"] = ENGINE_SERVING
        while not self._ctl["shutdown"] and not orphaned():
            started = time.monotonic()
            if not self.step():
                time.sleep(idle_sleep_s)
            elif self.step_s:
                time.sleep(max(0.0, started + self.step_s - time.monotonic()))
        for slot in np.flatnonzero(self.view.status["state"] == READY).tolist():
            self._finish(slot, FINISH_ABORT)
        for slot in list(self._running):
            self._finish(slot, FINISH_ABORT)
        self._ctl["engine_state"] = ENGINE_STOPPED

    # -- the four phases --------------------------------------------------------------------------------------------

    def _check_owned(self) -> None:
        status = self.view.status
        slots = np.fromiter(self._running, np.int64, len(self._running))
        epochs = np.fromiter(self._running.values(), np.int64, len(self._running))
        states, ring_epochs = status["state"][slots], status["epoch"][slots]
        moved = np.flatnonzero((states != RUNNING) | (ring_epochs != epochs))
        if moved.size:
            i = int(moved[0])
            slot, state = int(slots[i]), int(states[i])
            raise IllegalTransition(f"slot {slot} is RUNNING on the GPU side (epoch {int(epochs[i])}, "
                                    f"{int(status['n_generated'][slot])} generated) but the ring shows "
                                    f"{STATE_NAMES.get(state, state)} epoch {int(ring_epochs[i])}: "
                                    "only the GPU side may write a RUNNING slot")

    def _honour_cancels(self) -> None:
        # The announcing word first: a slot seen READY has its new epoch, so a stale cancel word (the previous
        # request's) cannot match it. Read the other way round, a recycled slot's new request was aborted unasked.
        status = self.view.status
        state = status["state"].copy()
        epoch, cancel = status["epoch"].copy(), status["cancel"].copy()
        cancelled = (cancel != 0) & (cancel == epoch) & ((state == READY) | (state == RUNNING))
        for slot in np.flatnonzero(cancelled).tolist():
            self._finish(slot, FINISH_ABORT)

    def _admit(self) -> None:
        status, headers = self.view.status, self.view.headers
        ready = np.flatnonzero(status["state"] == READY)
        ready = ready[np.argsort(headers["arrival_ns"][ready], kind="stable")]
        for slot in ready.tolist():
            if len(self._running) >= self.max_running:
                break
            if not self._servable(headers[slot]):
                self._finish(slot, FINISH_ERROR)
                continue
            check_transition(READY, RUNNING, GPU)
            self._reset_outputs(slot)
            status["state"][slot] = RUNNING
            self._running[slot] = int(status["epoch"][slot])
            self._ctl["admitted"] += 1

    def _generate(self) -> int:
        """Every running request's next token, as numpy arrays over the running slots (a Python loop cost ~5 µs a
        request: the stand-in fell behind one agent process); the stop checks per request, where one may apply."""
        if not self._running:
            return 0
        view = self.view
        slots = np.fromiter(self._running, np.int64, len(self._running))
        headers = view.headers[slots]
        n = view.status["n_generated"][slots].astype(np.int64)
        prompt_len = headers["prompt_len"].astype(np.int64)
        prev = np.where(n == 0, view.prompts[slots, prompt_len - 1],
                        view.outputs[slots, np.maximum(n - 1, 0)]).astype(np.uint64)
        position, seed = (prompt_len + n).astype(np.uint64), headers["seed"]
        tokens = standin_token(prev, position, seed, self.vocab_size)
        view.outputs[slots, n] = tokens
        if view.logprobs is not None:
            asked = (headers["request_flags"] & FLAG_LOGPROBS) != 0
            view.logprobs[slots[asked], n[asked]] = standin_logprob(prev[asked], position[asked], seed[asked])
        view.status["n_generated"][slots] = n + 1            # after the tokens: the agent reads the count first
        may_stop = (n + 1 >= headers["max_tokens"]) | (headers["n_stop"] != 0) | np.isin(tokens, self._eos_array)
        for i in np.flatnonzero(may_stop).tolist():
            slot = int(slots[i])
            reason = stop_reason(int(tokens[i]), int(n[i]) + 1, headers[i], self._stop_token_ids(slot),
                                 self.eos_token_ids)
            if reason != FINISH_NONE:
                self._finish(slot, reason)
        return len(slots)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _servable(self, header: np.void) -> bool:
        g_prompt, g_output = self.view.prompts.shape[1], self.view.outputs.shape[1]
        stop_capacity = 0 if self.view.stop_token_ids is None else self.view.stop_token_ids.shape[1]
        return (1 <= int(header["prompt_len"]) <= g_prompt and 1 <= int(header["max_tokens"]) <= g_output
                and int(header["n_stop"]) <= stop_capacity and not int(header["request_flags"]) & FLAG_GRAMMAR)

    def _stop_token_ids(self, slot: int):
        """The slot's row of stop token ids (empty in a ring without them)."""
        return () if self.view.stop_token_ids is None else self.view.stop_token_ids[slot]

    def _reset_outputs(self, slot: int) -> None:
        """The GPU owns the output words from admission on; they still hold the previous occupant's values."""
        self.view.status["n_generated"][slot] = 0
        self.view.status["finish_reason"][slot] = FINISH_NONE

    def _finish(self, slot: int, reason: int) -> None:
        status = self.view.status
        state = int(status["state"][slot])
        check_transition(state, FINISHED, GPU)
        if state == READY:
            self._reset_outputs(slot)
        status["finish_reason"][slot] = reason
        self._running.pop(slot, None)
        self._ctl["finished"] += 1                            # counted before the agent can see it finished
        if reason == FINISH_ABORT:
            self._ctl["cancelled"] += 1
        status["state"][slot] = FINISHED                      # last: the agent reads the state first


def serve_shared_ring(name: str, geometry: RingGeometry, parent: int, **consumer_options) -> None:
    """Process entry point: open the shared-memory ring ``name``, check its layout, serve it until shutdown or until
    process ``parent`` (which created the ring) is gone: a killed parent never asks for the shutdown, and its
    consumer would spin on forever. SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and the
    parent, draining, still needs its engine (it asks for the shutdown when the drain ends)."""
    import signal

    from blink.ring.transport import SharedMemory

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    layout = RingLayout(geometry)
    with SharedMemory.open(name, layout.size) as memory:
        layout.verify(memory.read(0, CONTROL_DTYPE.itemsize))
        consumer = ReferenceConsumer(layout.view(memory.buffer), **consumer_options)
        consumer.run(orphaned=lambda: os.getppid() != parent)


def check_step_s(step_s: float) -> float:
    """``step_s`` if it is a stand-in step time the consumer takes, else ``ValueError``."""
    if not 0 <= step_s <= 1:
        raise ValueError(f"the stand-in's step time must be in [0, 1] seconds (got {step_s!r})")
    return step_s


@contextmanager
def standin_engine(geometry: RingGeometry, **consumer_options):
    """A fresh shared-memory ring, served from another process by the reference consumer and its stand-in model.

    Yields ``(memory, process)``; on exit asks the consumer to shut down, then removes the ring (also when the
    consumer was killed meanwhile).
    """
    from blink.ring.transport import SharedMemory

    check_step_s(consumer_options.get("step_s", 0.0))     # here, not in the consumer's process
    layout = RingLayout(geometry)
    name = f"blink-{os.getpid()}-standin-{next(_standin_numbers)}-{uuid.uuid4().hex[:8]}"    # never a stale ring's
    with SharedMemory.create(name, layout.size) as memory:
        layout.initialise(memory)
        consumer = mp.get_context("spawn").Process(target=serve_shared_ring, args=(name, geometry, os.getpid()),
                                                   kwargs=consumer_options, daemon=True)
        consumer.start()
        log.info("ring /dev/shm/%s: %.1f MiB, %d slots; stand-in engine pid %d", name, layout.size / 2**20,
                 geometry.n_slots, consumer.pid)
        try:
            _wait_until_serving(memory, consumer)
            yield memory, consumer
        finally:
            control.request_shutdown(memory)
            consumer.join(10)
            consumer.kill()


def _wait_until_serving(memory, consumer) -> None:
    """Return once the consumer process serves the ring; ``EngineUnresponsive`` saying so if it died first (an agent
    would only see an engine that never beats) or never began."""
    deadline = time.monotonic() + STANDIN_START_S
    while int(control.read(memory)["engine_state"]) != ENGINE_SERVING:
        if not consumer.is_alive():
            raise EngineUnresponsive(
                f"the stand-in engine process (pid {consumer.pid}) exited with code {consumer.exitcode} before it "
                f"served the ring (its error is above). Run from a script, the code that starts it must be under "
                f"'if __name__ == \"__main__\":': multiprocessing's spawn imports the script again in the new "
                f"process, which must not start an engine of its own")
        if time.monotonic() > deadline:
            raise EngineUnresponsive(f"the stand-in engine process (pid {consumer.pid}) did not begin to serve the "
                                     f"ring within {STANDIN_START_S:.0f} s")
        time.sleep(0.005)
