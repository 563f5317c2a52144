"""Pure-Python specifications of the scheduler's waiting queue (``waiting.py``), batcher (``batcher.py``) and draft
lookup (``speculation.py``).

Each reference is written sequentially and for readability, from the modules' docstrings, not from their block-wide
code: the device tests drive one phase under the simulator and compare every word it leaves with these.

``WaitingQueue``: what ``collect`` + ``enqueue`` (a scan) and ``cancel_queued`` do to the queue, the ``seq_seen``
marks and the refused (finished-while-READY) slots. ``Batcher``: what ``admit`` and ``plan`` do to the running list,
the pages (through ``KVMirror``, the allocator's own reference) and the step's inputs. ``prompt_lookup``: the drafts
``lookup`` finds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from blink.device.mirror import KVMirror
from blink.ring.layout import FINISH_ABORT, FINISH_ERROR, READY

QUEUED, REFUSED = 1, 2          # seq_seen marks (state.py)
INT64 = (-(1 << 63), (1 << 63) - 1)


# -- the waiting queue --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """What a scan reads of one ring slot: its status words and the header fields it checks and keys on."""

    slot: int
    state: int
    epoch: int
    cancel: int
    prompt_len: int          # header words are u32 in the ring; the device reads them as i32
    max_tokens: int
    n_stop: int
    arrival_ns: int
    priority: int
    request_id: int


def as_i32(u32: int) -> int:
    return u32 - (1 << 32) if u32 >= 1 << 31 else u32


def as_i64(u64: int) -> int:
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64


def read_ring(view) -> list[Request]:
    """Every slot of a ``RingView`` as the scan sees it (header words reinterpreted as the device reads them)."""
    status, headers = view.status, view.headers
    return [Request(slot, int(status["state"][slot]), int(status["epoch"][slot]), int(status["cancel"][slot]),
                    as_i32(int(h["prompt_len"])), as_i32(int(h["max_tokens"])), as_i32(int(h["n_stop"])),
                    as_i64(int(h["arrival_ns"])), int(h["priority"]), as_i64(int(h["request_id"])))
            for slot, h in enumerate(headers)]


@dataclass(frozen=True)
class Limits:
    """What makes a request servable: the ring's geometry and the scheduler's ``max_model_len``."""

    max_prompt_tokens: int
    max_output_tokens: int
    max_stop_ids: int
    max_model_len: int

    def servable(self, r: Request) -> bool:
        return (1 <= r.prompt_len <= self.max_prompt_tokens and 1 <= r.max_tokens <= self.max_output_tokens
                and 0 <= r.n_stop <= self.max_stop_ids and r.prompt_len + r.max_tokens <= self.max_model_len)


def fcfs_key(r: Request) -> int:
    return r.arrival_ns


def by_priority_key(r: Request) -> int:
    """Priority clamped to +-2**22, above the low 40 bits of the request id (policy.by_priority)."""
    level = max(min(r.priority, 1 << 22), -(1 << 22))
    return level * (1 << 40) + (r.request_id & ((1 << 40) - 1))


def cancelled(r: Request) -> bool:
    """The agent writes the epoch of the request it cancels; 0 (or an older epoch) cancels nothing."""
    return r.cancel != 0 and r.cancel == r.epoch


@dataclass
class WaitingQueue:
    """The waiting queue: READY requests the scheduler has seen, as ``[(key, slot)]`` sorted ascending.

    - ``scan``: every READY slot not yet seen is taken: a cancelled one is refused with "abort", an unservable one
      with "error" (both marked REFUSED, finish pending), any other is keyed by the policy, marked QUEUED and merged
      into the queue, which stays sorted by (key, slot);
    - ``cancel_queued``: queued entries whose request is cancelled are refused with "abort"; the rest keep their order;
    - ``pop(k)``: admission takes the first ``k`` (their marks are cleared);
    - ``publish``: refused slots whose FINISHED state is published lose their mark (the agent may then reuse them).
    """

    limits: Limits
    key: callable
    queue: list[tuple[int, int]] = field(default_factory=list)
    seen: dict[int, int] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)       # refused slot -> finish reason, not yet published
    loaded: dict[int, Request] = field(default_factory=dict)    # queued slot -> the header copied at the scan

    def scan(self, ring: list[Request]) -> dict[str, int]:
        counts = dict(new=0, refused=0, cancelled=0)
        new = []
        for r in ring:
            if r.state != READY or r.slot in self.seen:
                continue
            if cancelled(r):
                self._refuse(r.slot, FINISH_ABORT, counts)
            elif not self.limits.servable(r):
                self._refuse(r.slot, FINISH_ERROR, counts)
            else:
                key = self.key(r)
                assert INT64[0] <= key <= INT64[1], "a policy key must be an int64"
                new.append((key, r.slot))
                self.seen[r.slot] = QUEUED
                self.loaded[r.slot] = r
                counts["new"] += 1
        self.queue = sorted(self.queue + new)
        return counts

    def cancel_queued(self, ring: list[Request]) -> dict[str, int]:
        counts = dict(new=0, refused=0, cancelled=0)
        kept = []
        for key, slot in self.queue:
            if cancelled(ring[slot]):
                self._refuse(slot, FINISH_ABORT, counts)
            else:
                kept.append((key, slot))
        self.queue = kept
        return counts

    def pop(self, k: int) -> list[int]:
        taken, self.queue = self.queue[:k], self.queue[k:]
        for _, slot in taken:
            del self.seen[slot]
        return [slot for _, slot in taken]

    def publish(self, slots) -> None:
        for slot in slots:
            del self.pending[slot]
            del self.seen[slot]

    def _refuse(self, slot: int, reason: int, counts: dict[str, int]) -> None:
        assert slot not in self.pending, "a slot refused twice"
        self.seen[slot] = REFUSED
        self.pending[slot] = reason
        counts["refused"] += 1
        counts["cancelled"] += reason == FINISH_ABORT


# -- admission and planning ---------------------------------------------------------------------------------------


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class Sequence:
    """A request the batcher knows: its prompt, the tokens generated so far, and how many tokens are in the cache."""

    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token(self, position: int) -> int:
        return (self.prompt + self.generated)[position]


@dataclass
class Step:
    """A planned step: one row per sequence with a chunk, in running order, and its token rows."""

    rows: list[tuple[int, int, int]]     # (slot, first position, chunk)
    bucket: int                          # index into the buckets
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    logits_indices: list[int]            # per row: its last token row, or -1 when the chunk does not reach the end


@dataclass
class Batcher:
    """The batching policy of ``batcher.py``, one sequence at a time.

    ``admit``: from the head of the queue while fewer than ``max_num_seqs`` run and the whole prompt of each fits in
    the free pages above the watermark, counting the prompts admitted before it; the first misfit blocks the rest.

    ``plan``: a sequence with one token left to compute is a decode, any other a prefill. While the decodes' new
    pages exceed the free pages, the most recently admitted sequence holding pages is preempted (pages freed, nothing
    computed). Prefills then get, in running order, what is left of the token budget after one token per decode;
    then, in running order again, each chunk is cut to what its own pages and the pages still free hold (budget that
    a page-cut chunk gives up is not passed on to later prefills of the same step). A plan in which some sequence
    does not decode and no prefill got a token preempts the newest page holder and plans again. Chunks get their
    pages (``KVMirror`` order, running order); the rows are the sequences with a chunk; the bucket is the smallest
    that holds the tokens.
    """

    page_size: int
    token_budget: int
    max_num_seqs: int
    watermark: int
    buckets: tuple[int, ...]
    kv: KVMirror
    seqs: dict[int, Sequence] = field(default_factory=dict)     # slot -> sequence (running or queued)
    running: list[int] = field(default_factory=list)            # slots, in admission order
    queue: list[int] = field(default_factory=list)              # waiting slots, head first
    preempted: list[int] = field(default_factory=list)          # victims of the last plan, in order

    def pages(self, slot: int) -> list[int]:
        return self.kv.tables.get(slot, [])

    def admit(self) -> list[int]:
        window = self.queue[:self.max_num_seqs - len(self.running)]
        free = self.kv.free_total - self.watermark
        admitted, need = [], 0
        for slot in window:
            need += pages_for(len(self.seqs[slot].prompt), self.page_size)
            if need > free:
                break
            admitted.append(slot)
        for slot in admitted:
            seq = self.seqs[slot]
            seq.generated, seq.computed = [], 0
        self.running += admitted
        self.queue = self.queue[len(admitted):]
        return admitted

    def _preempt_newest(self) -> bool:
        for slot in reversed(self.running):
            if self.pages(slot):
                self.kv.free_sequences([slot])
                self.seqs[slot].computed = 0
                self.preempted.append(slot)
                return True
        return False

    def _remaining(self, slot: int) -> int:
        return self.seqs[slot].total - self.seqs[slot].computed

    def _chunks(self) -> tuple[dict[int, int], bool]:
        """One planning pass: slot -> chunk, and whether every running sequence decodes."""
        page = self.page_size
        while True:
            decodes = [slot for slot in self.running if self._remaining(slot) == 1]
            decode_pages = sum(max(0, pages_for(self.seqs[slot].computed + 1, page) - len(self.pages(slot)))
                               for slot in decodes)
            if decode_pages <= self.kv.free_total or not self._preempt_newest():
                break
        chunks = {slot: 1 for slot in decodes}
        if len(decodes) == len(self.running):
            return chunks, True
        prefills = [slot for slot in self.running if slot not in chunks]
        tokens_left = self.token_budget - len(decodes)
        for slot in prefills:                   # the budget, in running order
            chunks[slot] = min(self._remaining(slot), tokens_left)
            tokens_left -= chunks[slot]
        pages_left = self.kv.free_total - decode_pages
        for slot in prefills:                   # then the free pages, in running order
            seq, held = self.seqs[slot], len(self.pages(slot))
            chunks[slot] = min(chunks[slot], (held + pages_left) * page - seq.computed)
            pages_left -= pages_for(seq.computed + chunks[slot], page) - held
        return chunks, False

    def plan(self) -> Step | None:
        self.preempted = []
        if not self.running:
            return None
        while True:
            chunks, all_decode = self._chunks()
            if all_decode or any(c > 0 for c in chunks.values()) or not self._preempt_newest():
                break
        page = self.page_size
        with_chunk = [slot for slot in self.running if chunks[slot] > 0]
        self.kv.allocate(with_chunk, [max(0, pages_for(self.seqs[slot].computed + chunks[slot], page)
                                              - len(self.pages(slot))) for slot in with_chunk])
        rows, token_ids, positions, slot_mapping, logits = [], [], [], [], []
        for slot in with_chunk:
            seq, chunk = self.seqs[slot], chunks[slot]
            rows.append((slot, seq.computed, chunk))
            for position in range(seq.computed, seq.computed + chunk):
                token_ids.append(seq.token(position))
                positions.append(position)
                slot_mapping.append(self.pages(slot)[position // page] * page + position % page)
            logits.append(len(positions) - 1 if seq.computed + chunk == seq.total else -1)
        if not positions:
            return None
        bucket = next(b for b, size in enumerate(self.buckets) if size >= len(positions))
        return Step(rows, bucket, token_ids, positions, slot_mapping, logits)

    def consume(self, step: Step, sampled: dict[int, int]) -> None:
        """The next iteration's view of the step: chunks are computed; rows that reached the end sampled a token."""
        for slot, _, chunk in step.rows:
            seq = self.seqs[slot]
            seq.computed += chunk
            if seq.computed == seq.total:
                seq.generated.append(sampled[slot])


# -- speculation --------------------------------------------------------------------------------------------------


def prompt_lookup(tokens: list[int], most: int, low: int, high: int) -> list[int]:
    """At most ``most`` tokens that followed the latest earlier occurrence of the last ``n`` of ``tokens``, for the
    largest ``n`` in ``[low, high]`` that has one (none: [])."""
    if most == 0:
        return []
    for n in range(high, low - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + most]
    return []
