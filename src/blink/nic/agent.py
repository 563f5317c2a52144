"""The agent's side of the ring protocol: submit requests, poll their tokens, cancel, release slots.

Every access goes through a ``RemoteMemory`` by byte offset, so the same agent drives an in-process ring, a shared-
memory ring or (later) an RDMA ring. Per request the agent writes the header and prompt, then publishes the state
word; per ``poll()`` it does one bulk read of the control block and every slot's status, and reads token ranges only
for slots that made progress. A slot is released (written FREE) only after the GPU side marked it FINISHED and every
one of its tokens was returned by ``poll()``.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np

from blink.errors import EngineUnresponsive, IllegalTransition, RingFull
from blink.nic.grammar_table import GrammarTable
from blink.nic.liveness import Liveness
from blink.nic.request_checks import checked_prompt
from blink.nic.slots import SlotTracker
from blink.ring import control
from blink.ring.control import CONTROL_DTYPE, ENGINE_STOPPED
from blink.ring.geometry import RingGeometry
from blink.ring.hashing import prompt_keys
from blink.ring.layout import (AGENT, FINISH_NAMES, FINISHED, FREE, PAIR_DTYPE, READY, RUNNING, RingLayout,
                               check_transition)
from blink.ring.request import SamplingParams, encode_header, encode_logit_bias, encode_stop_token_ids
from blink.ring.shares import Share
from blink.ring.transport import RemoteMemory

_U32 = np.dtype("<u4")


@dataclass(frozen=True)
class RequestOutput:
    """What ``poll()`` learned about one request since the previous poll."""

    request_id: int
    new_tokens: list[int]
    new_logprobs: list[float] | None   # only for requests submitted with ``logprobs=True``
    finished: bool
    finish_reason: str | None          # "stop", "length", "abort" or "error" once finished
    # Only for requests submitted with ``top_logprobs``: per new token, its (token, logprob) pairs, most likely first.
    new_top_logprobs: list[list[tuple[int, float]]] | None = None


class Agent:
    """Drives one ring, or its ``share`` of one (``blink.ring.shares``: its slots, its part of the grammars region,
    its doorbell values) where several agents serve it. Not thread-safe: one agent (one thread) per share.

    ``liveness_timeout_s``: how long the engine may show no sign of life (``blink.nic.liveness``) while requests are
    in flight before ``poll()`` raises ``EngineUnresponsive`` instead of waiting forever.
    ``seed``: where the sampling seeds of requests that bring none come from (``blink serve --seed``): the same seed
    gives the n-th such request the same seed, so a restarted server answers them with the same tokens whatever else
    is batched with them; None: a random start.
    """

    def __init__(self, memory: RemoteMemory, geometry: RingGeometry, *, liveness_timeout_s: float = 10.0,
                 seed: int | None = None, share: Share = Share()):
        self.memory = memory
        self.layout = layout = RingLayout(geometry)
        if memory.size < layout.size:
            raise ValueError(f"the ring region is {memory.size} bytes but RingGeometry {geometry} needs {layout.size}")
        layout.verify(memory.read(0, CONTROL_DTYPE.itemsize))
        self.geometry, self.share = geometry, share
        self.liveness_timeout_s = liveness_timeout_s
        n = geometry.n_slots
        self.slots = share.slots(n)
        # The status region starts after the control block; reading [0, status end) gets both in one read.
        self._status_offset = layout.offset("status")
        self._snapshot_bytes = self._status_offset + layout.status_dtype.itemsize
        # Where this agent's slots' words lie in that read, per column: a poll that finds them as the last one did
        # has nothing to do (other agents' slots are theirs).
        self._mine = [(at := layout.status_at(column, self.slots.start), at + 4 * len(self.slots))
                      for column in layout.status_dtype.names]
        self._last_status: list[bytes] | None = None  # this agent's status words as the last full poll read them
        self._unfinished = 0                        # requests in flight the GPU side has not finished, then
        block, status = self._snapshot()
        self.tracker = SlotTracker(n, self.slots)
        self.tracker.refresh(status["state"])
        self._epoch = status["epoch"].copy()
        self._request_id = np.zeros(n, np.uint64)   # 0 = slot not in flight for this agent
        self._delivered = np.zeros(n, np.int64)     # tokens already returned by poll()
        self._wants_logprobs = np.zeros(n, bool)
        self._top_logprobs = np.zeros(n, np.int32)  # top logprobs per token the request asked for
        self._grammar: list = [None] * n            # the grammar each slot's request follows, placed in the ring
        self.grammars = GrammarTable(geometry, lambda word, data: memory.write(layout.grammar_at(word), data),
                                     share.words(layout.grammar_words))
        self._seen_running = np.zeros(n, bool)      # the agent has re-read n_generated since admission
        self._slot_of: dict[int, int] = {}
        self._taken_over: set[int] = set()          # requests a gone agent of this range left, being cancelled
        self._next_id = 1
        self.liveness = Liveness(liveness_timeout_s)
        self._seeds = random.Random(seed)
        self._waiting_since: float | None = None    # when requests last started waiting on an idle ring
        # Doorbell writes continue from an earlier agent's values, each one new (blink.ring.shares).
        self._submitted = share.first_count(int(block["submitted"]))
        self._cancels = share.first_count(int(block["cancels"]))
        self._prefix_seed = int(block["prefix_seed"])   # the ring creator's: keys must match the GPU's

    @classmethod
    def attach(cls, memory: RemoteMemory, share: Share = Share(), **options) -> Agent:
        """An agent on ``share`` of an existing ring, with the geometry its creator wrote into the control block;
        the only agent of its slots until ``memory`` is closed (``RingRefused`` if another agent holds any: two
        would take each other's slots and answer with each other's tokens). What an agent of those slots that is
        gone left in the ring, it finishes (``take_over``)."""
        geometry = control.geometry_of(memory.read(0, control.CONTROL_DTYPE.itemsize))
        memory.claim_agent(share.slots(geometry.n_slots))
        agent = cls(memory, geometry, share=share, **options)
        agent.take_over()
        return agent

    def take_over(self) -> None:
        """Finish what an agent of these slots left in the ring when it died: a FINISHED slot is freed, a READY or
        RUNNING one cancelled and freed once finished (its tokens go nowhere; no grammar is placed meanwhile: theirs
        may still be read). Only for an agent that holds its slots (``attach``): others' requests are not its own."""
        state = self._snapshot()[1]["state"]
        for slot in self.slots:
            if state[slot] == FINISHED:
                check_transition(FINISHED, FREE, AGENT)
                self._write_word("state", slot, FREE)
            elif state[slot] in (READY, RUNNING):
                request_id = self._next_id
                self._next_id += 1
                self.tracker.hold(slot)
                self._track(slot, request_id, SamplingParams(), None)
                self._taken_over.add(request_id)
                self.cancel(request_id)
        self.tracker.refresh(self._snapshot()[1]["state"])

    def others_busy(self) -> bool:
        """Whether another agent of this ring has a request in it (a slot outside this one's is not FREE): one read
        of the state column; no read for the ring's only agent."""
        if self.share.agents == 1:
            return False
        raw = self.memory.read(self.layout.status_at("state", 0), 4 * self.geometry.n_slots)
        busy = np.frombuffer(raw, _U32) != FREE
        return int(busy.sum()) > int(busy[self.slots.start:self.slots.stop].sum())

    @property
    def in_flight(self) -> int:
        return len(self._slot_of)

    def submit(self, prompt_tokens, params: SamplingParams = SamplingParams(), *, priority: int = 0) -> int:
        """Publish one request; return its id. Raises ``RequestError`` (a ``ValueError``) naming the field (ring
        untouched, no slot claimed) or ``RingFull``.

        ``priority`` is passed to the GPU's admission policy (the default policy, FCFS, ignores it).
        """
        prompt = checked_prompt(self.geometry, self.grammars, prompt_tokens, params)
        request_id = self._next_id
        seed = self._seeds.getrandbits(64) if params.seed is None else params.seed
        page_size = self.geometry.prefix_page_size
        keys, state = prompt_keys(prompt, page_size, self._prefix_seed) if page_size else (None, 0)
        grammar = params.grammar
        if grammar is not None and self._taken_over:
            raise RingFull("the requests a gone agent of these slots left are being finished: a grammar waits for "
                           "them (theirs may still be read)")
        # Placed first (the table may have no room now: RingFull); let go of if the request is not published.
        placement = self.grammars.acquire(grammar) if grammar is not None else 0
        try:
            header = encode_header(request_id=request_id, arrival_ns=time.monotonic_ns(), seed=seed,
                                   prompt_len=len(prompt), params=params, priority=priority, prefix_state=state,
                                   grammar=placement)
            slot = self.tracker.claim()
            try:
                self._publish(slot, header, encode_stop_token_ids(params), prompt, keys, encode_logit_bias(params))
            except BaseException:
                self.tracker.release(slot)      # the slot was never published READY: it is still the agent's
                raise
        except BaseException:
            if grammar is not None:
                self.grammars.release(grammar)
            raise
        self._next_id += 1
        self._track(slot, request_id, params, grammar)
        return request_id

    def _track(self, slot: int, request_id: int, params: SamplingParams, grammar) -> None:
        """``slot`` holds ``request_id`` (asking for ``params``' outputs), in flight from now on."""
        self._grammar[slot] = grammar
        self._request_id[slot] = request_id
        self._delivered[slot] = 0
        self._seen_running[slot] = False
        self._wants_logprobs[slot] = params.logprobs
        self._top_logprobs[slot] = params.top_logprobs
        self._slot_of[request_id] = slot

    def _publish(self, slot: int, header: bytes, stops: bytes, prompt: np.ndarray, keys: np.ndarray | None,
                 bias: bytes) -> None:
        """Payload first, then the new epoch, then READY, then the doorbell (docs/architecture.md)."""
        epoch = int(self._epoch[slot]) % 0xFFFFFFFF + 1      # never 0: cancel == 0 means "no cancel"
        layout = self.layout
        for offset, payload in ((layout.header_at(slot), header), (layout.stop_token_ids_at(slot), stops),
                                (layout.prompt_at(slot), prompt.tobytes()), (layout.logit_bias_at(slot), bias),
                                (layout.prefix_keys_at(slot), b"" if keys is None else keys.astype("<u8").tobytes())):
            if payload:     # a request without stop ids, logit_bias or prefix keys has none of them to write
                self.memory.write(offset, payload)
        self._write_word("epoch", slot, epoch)
        self._epoch[slot] = epoch
        check_transition(FREE, READY, AGENT)
        self._write_word("state", slot, READY)
        self._submitted += 1
        self._ring_doorbell("submitted", self.share.doorbell(self._submitted))

    def poll(self) -> list[RequestOutput]:
        """One bulk read of the control block and status words; return the progress of every request that moved.

        Between two engine steps most polls find nothing: when every status word reads as the previous poll read
        it (no GPU write, no agent write since), nothing can have moved, and the poll ends after the liveness check
        (a read and a compare, not the scan of every slot). Only this agent's slots count: the others are another
        agent's."""
        raw = self.memory.read(0, self._snapshot_bytes)
        block = control.decode(raw)
        mine = [raw[start:end] for start, end in self._mine]
        if mine == self._last_status:
            self._check_liveness(block, self._unfinished)
            return []
        self._last_status = mine
        status = np.frombuffer(raw, self.layout.status_dtype, count=1, offset=self._status_offset)[0]
        state = status["state"]
        active = self._request_id != 0
        self._unfinished = int(np.count_nonzero(active & (state != FINISHED)))
        self._check_liveness(block, self._unfinished)
        self.tracker.refresh(state)
        # A READY slot's n_generated is the previous occupant's until the GPU zeroes it at admission, and one read
        # does not order the two columns: the first time a slot shows RUNNING, re-read its count.
        n_generated = status["n_generated"].copy()
        newly_running = active & (state == RUNNING) & ~self._seen_running
        for slot in np.flatnonzero(newly_running).tolist():
            n_generated[slot] = self._read_word("n_generated", slot)
        self._seen_running |= newly_running
        progressed = np.flatnonzero(active & (((state == RUNNING) & (n_generated > self._delivered))
                                              | (state == FINISHED)))
        wrong = progressed[status["epoch"][progressed] != self._epoch[progressed]]
        if wrong.size:
            slot = int(wrong[0])
            raise IllegalTransition(f"slot {slot}'s epoch changed from {int(self._epoch[slot])} to "
                                    f"{int(status['epoch'][slot])} under the agent: another writer uses this ring")
        outputs = []
        # Python ints per moved slot, taken from the arrays in three gathers rather than element by element.
        for slot, finished, end in zip(progressed.tolist(), (state[progressed] == FINISHED).tolist(),
                                       n_generated[progressed].tolist(), strict=True):
            if finished:
                # Everything the GPU wrote before FINISHED is visible now: re-read the words it announces.
                outputs.append(self._collect(slot, self._read_word("n_generated", slot),
                                             self._read_word("finish_reason", slot)))
            else:
                outputs.append(self._collect(slot, end, None))
        return outputs

    def cancel(self, request_id: int) -> bool:
        """Ask the GPU side to finish a request with reason "abort". False if it is not in flight."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            return False
        self._write_word("cancel", slot, int(self._epoch[slot]))
        self._cancels += 1
        self._ring_doorbell("cancels", self.share.doorbell(self._cancels))
        return True

    def request_shutdown(self) -> None:
        """Ask the GPU loop to finish in-flight requests with "abort" and stop."""
        control.request_shutdown(self.memory)

    def stats(self) -> dict[str, int]:
        """The GPU side's counters and gauges from the control block."""
        return control.read(self.memory)

    # -- internals ------------------------------------------------------------------------------------------------

    def validate(self, prompt_tokens, params: SamplingParams = SamplingParams(), priority: int = 0) -> None:
        """Every check ``submit`` makes before it claims a slot: ``RequestError`` naming the field, or None."""
        prompt = checked_prompt(self.geometry, self.grammars, prompt_tokens, params)
        encode_header(request_id=self._next_id, arrival_ns=0, seed=params.seed or 0, prompt_len=len(prompt),
                      params=params, priority=priority)

    def _snapshot(self) -> tuple[np.void, np.void]:
        raw = self.memory.read(0, self._snapshot_bytes)
        return control.decode(raw), np.frombuffer(raw, self.layout.status_dtype, count=1, offset=self._status_offset)[0]

    def _read_word(self, column: str, slot: int) -> int:
        return int(np.frombuffer(self.memory.read(self.layout.status_at(column, slot), 4), _U32)[0])

    def _ring_doorbell(self, name: str, count: int) -> None:
        self.memory.write(control.offset_of(name), np.array([count], "<u8").tobytes())

    def _write_word(self, column: str, slot: int, value: int) -> None:
        self.memory.write(self.layout.status_at(column, slot), np.array([value], _U32).tobytes())

    def _check_liveness(self, block: np.void, unfinished: int) -> None:
        """Raise if the GPU side reported a launch error, or if requests have waited ``liveness_timeout_s`` on an
        engine that counts as dead (a stall while nothing waited is no alarm: a stepped test consumer idles so)."""
        now = time.monotonic()
        problem = self.liveness.problem(block, now)
        if not unfinished:
            self._waiting_since = None
            if problem and int(block["launch_error"]):
                raise EngineUnresponsive(problem)
            return
        if self._waiting_since is None:
            self._waiting_since = now
        if problem and (int(block["launch_error"]) or now - self._waiting_since > self.liveness_timeout_s
                        or int(block["engine_state"]) == ENGINE_STOPPED):
            raise EngineUnresponsive(f"{problem} ({unfinished} requests unfinished)")

    def _collect(self, slot: int, end: int, finish_reason: int | None) -> RequestOutput:
        """New tokens ``[delivered, end)`` of ``slot``; ``finish_reason`` is None while the request runs."""
        request_id = int(self._request_id[slot])
        start = int(self._delivered[slot])
        tokens, logprobs = [], None
        if end > start:
            raw = self.memory.read(self.layout.output_at(slot, start), 4 * (end - start))
            tokens = np.frombuffer(raw, "<i4").tolist()
        if self._wants_logprobs[slot]:
            logprobs = []
            if end > start:
                raw = self.memory.read(self.layout.logprob_at(slot, start), 4 * (end - start))
                logprobs = np.frombuffer(raw, "<f4").tolist()
        self._delivered[slot] = end
        top = self._read_top_logprobs(slot, start, end) if self._top_logprobs[slot] else None
        finished = finish_reason is not None
        if finished:
            self._release(slot, request_id)
        return RequestOutput(request_id, tokens, logprobs, finished,
                             (FINISH_NAMES.get(finish_reason) or "error") if finished else None, top)

    def _read_top_logprobs(self, slot: int, start: int, end: int) -> list[list[tuple[int, float]]]:
        """The first ``top_logprobs`` pairs of each output position ``[start, end)`` of ``slot``: one read. Tokens of
        probability 0 (a grammar forbids them: logprob -inf) are left out."""
        if end <= start:
            return []
        k = self.geometry.max_top_logprobs
        raw = self.memory.read(self.layout.top_logprobs_at(slot, start), PAIR_DTYPE.itemsize * k * (end - start))
        pairs = np.frombuffer(raw, PAIR_DTYPE).reshape(end - start, k)[:, :self._top_logprobs[slot]]
        return [[(t, v) for t, v in zip(row["token"].tolist(), row["value"].tolist()) if v != -math.inf]
                for row in pairs]

    def _release(self, slot: int, request_id: int) -> None:
        check_transition(FINISHED, FREE, AGENT)
        if self._grammar[slot] is not None:     # FINISHED: the GPU side reads its grammar no more
            self.grammars.release(self._grammar[slot])
            self._grammar[slot] = None
        self._write_word("state", slot, FREE)
        self.tracker.release(slot)
        self._request_id[slot] = 0
        del self._slot_of[request_id]
        self._taken_over.discard(request_id)
