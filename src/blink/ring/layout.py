"""The NIC↔GPU contract: one contiguous region of request slots, output areas and a control block.

Both sides address the region by byte offsets, so every transport (in-process buffer, POSIX shared memory, RDMA)
sees the same layout. The layout is a pure function of a ``RingGeometry``; ``RingLayout.verify`` checks that an
existing region was written for the same geometry and names the first field that differs.

Regions, each starting on a 4 KiB boundary::

    control   CONTROL_DTYPE (384 B)           magic, version, geometry, shutdown, heartbeat, stats
    status    5 columns of u32 [n_slots]      state, epoch, cancel, finish_reason, n_generated
    headers   [n_slots] HEADER_DTYPE (96 B)   request id, arrival time, sampling params (named as SamplingParams')
    stop_token_ids [n_slots, max_stop_ids] int32     (only when max_stop_ids)
    prompts   [n_slots, max_prompt_tokens] int32
    prefix_keys [n_slots, geometry.prefix_key_pages] uint64   (only when geometry.prefix_page_size)
    logit_bias [n_slots, max_logit_bias] PAIR_DTYPE (token, bias)
    grammars  [max_grammar_bytes // 4] int32          compiled grammars (ring/grammar.py; only when max_grammar_bytes)
    outputs   [n_slots, max_output_tokens] int32
    logprobs  [n_slots, max_output_tokens] float32   (only when geometry.logprobs)
    top_logprobs [n_slots, max_output_tokens, max_top_logprobs] PAIR_DTYPE (token, logprob)

The status words of all slots are contiguous so that the agent learns the state and progress of every slot with
ONE bulk read, and the GPU scans the packed state column with coalesced loads.

State machine (``TRANSITIONS``), one writer per transition, so no atomics are needed across PCIe::

    FREE ─agent→ READY ─gpu→ RUNNING ─gpu→ FINISHED ─agent→ FREE
                 READY ─gpu→ FINISHED        (cancelled or unservable before it ran)

The agent owns a slot while it is FREE or FINISHED, the GPU while it is READY or RUNNING: only the owner writes the
state word. A cancel is a request, not a state: the agent writes the request's epoch into ``cancel`` (a word only
it writes) and the GPU finishes the slot with reason ``abort`` at its next iteration. The epoch increments each time
the agent reuses a slot, so a late cancel or a stale read of a recycled slot is detectable.

Doorbells: after publishing READY the agent bumps ``submitted``, after writing a cancel word it bumps ``cancels``
(both in the control block, both written only by the agent). The GPU reads these two words every iteration and scans
the state column or the cancel words only when one moved, so an iteration with nothing new reads three words across
PCIe instead of every slot.

Ordering: a writer publishes the payload before the word that announces it (agent: header, stop token ids, prompt,
prefix keys and epoch, then ``state = READY``, then ``submitted``; GPU: zero ``n_generated`` and ``finish_reason``,
fence, ``state = RUNNING``; tokens, fence, then ``n_generated``; ``finish_reason``, fence, then ``state = FINISHED``). A
reader loads the announcing word first, then the payload. The agent ignores ``n_generated`` and ``finish_reason`` of
a READY slot: they still hold the previous request's values until the GPU admits it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.ring import control
from blink.ring.control import CONTROL_DTYPE, struct
from blink.ring.errors import IllegalTransition
from blink.ring.geometry import RingGeometry

REGION_ALIGN = 4096

# Slot states.
FREE, READY, RUNNING, FINISHED = 0, 1, 2, 3
STATE_NAMES = {FREE: "FREE", READY: "READY", RUNNING: "RUNNING", FINISHED: "FINISHED"}

# Finish reasons (written with FINISHED). Names follow the OpenAI API / vLLM.
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = 0, 1, 2, 3, 4
FINISH_NAMES = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort",
                FINISH_ERROR: "error"}

# Request header flags.
FLAG_IGNORE_EOS = 1
FLAG_LOGPROBS = 2
FLAG_GRAMMAR = 4        # the output follows the grammar whose start state is the header's ``grammar``

AGENT, GPU = "agent", "gpu"
TRANSITIONS = {
    (FREE, READY): AGENT,
    (READY, RUNNING): GPU,
    (READY, FINISHED): GPU,
    (RUNNING, FINISHED): GPU,
    (FINISHED, FREE): AGENT,
}


def check_transition(old: int, new: int, writer: str) -> None:
    """Raise ``IllegalTransition`` unless ``writer`` may move a slot from ``old`` to ``new``."""
    allowed = TRANSITIONS.get((old, new))
    if allowed != writer:
        who = f"only the {allowed}" if allowed else "nobody"
        raise IllegalTransition(
            f"{writer} may not move a slot {STATE_NAMES.get(old, old)} -> {STATE_NAMES.get(new, new)} ({who} may)")


# The status table is column-major: one u32 column per field, each ``[n_slots]`` and padded to 64 bytes, so the
# GPU's scan for READY slots reads only the packed state column and the agent still gets everything in one read.
STATUS_COLUMNS = (
    "state",          # owner of the slot (see module docstring)
    "epoch",          # agent, while FREE: +1 per reuse of the slot, never 0
    "cancel",         # agent: epoch of the request to cancel
    "finish_reason",  # GPU: zeroed at admission, set before state = FINISHED
    "n_generated",    # GPU: zeroed at admission, then bumped after the tokens it counts
)


def status_dtype(n_slots: int) -> np.dtype:
    """One record whose fields are the status columns: ``record["state"]`` is the ``[n_slots]`` state column."""
    stride = status_column_stride(n_slots)
    return struct([(name, ("<u4", (n_slots,)), i * stride) for i, name in enumerate(STATUS_COLUMNS)],
                   stride * len(STATUS_COLUMNS))


def status_column_stride(n_slots: int) -> int:
    return _round_up(4 * n_slots, 64)


TOKEN_DTYPE = np.dtype("<i4")   # a token id, as the prompts, stop_token_ids and outputs regions store it

# An element of the logit_bias and top_logprobs regions: a token id and a float32 (its bias, or its logprob). The
# GPU side reads a slot's pairs as one row of 32-bit words: the token at word 2 k, the number at word 2 k + 1.
PAIR_DTYPE = struct([("token", "<i4", 0), ("value", "<f4", 4)], 8)

# A request's header, the one schema of what a request asks for: the agent encodes it by these names
# (``blink.ring.request``), the GPU scheduler reads it by them (``s.headers[slot].temperature``). A field that is a
# ``SamplingParams`` field has its name. Its stop token ids are a region of their own (``stop_token_ids``), so the
# header's size does not depend on the geometry.
HEADER_DTYPE = struct([
    ("request_id", "<u8", 0),
    ("arrival_ns", "<u8", 8),
    ("seed", "<u8", 16),            # the request's seed, or the one the agent picked for it
    ("prompt_len", "<u4", 24),
    ("max_tokens", "<u4", 28),
    ("temperature", "<f4", 32),
    ("top_p", "<f4", 36),
    ("top_k", "<i4", 40),
    ("request_flags", "<u4", 44),   # FLAG_* ("flags" would read as numpy's own attribute of a record)
    ("n_stop", "<u4", 48),          # valid ids in the slot's stop_token_ids row
    ("priority", "<i4", 52),
    ("prefix_state", "<u8", 56),    # the prompt's prefix-key chain state (ring/hashing.py), 0 without keys
    ("presence_penalty", "<f4", 64),
    ("frequency_penalty", "<f4", 68),
    ("repetition_penalty", "<f4", 72),
    ("min_p", "<f4", 76),
    ("top_logprobs", "<u4", 80),    # top logprobs per output position (0: none)
    ("n_logit_bias", "<u4", 84),    # valid pairs in the slot's logit_bias row
    ("grammar", "<u4", 88),         # with FLAG_GRAMMAR: its placement's first word in the grammars region
    ("num_speculative_tokens", "<u4", 92),  # the request's cap on drafts per step (MAX_SPECULATIVE_TOKENS: none)
], 96)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class RingView:
    """Numpy views of a whole ring region, for a side that has it in its own address space."""

    control: np.ndarray        # shape (1,), CONTROL_DTYPE
    status: np.void            # status_dtype(n_slots) record: status["state"] is the state column
    headers: np.ndarray        # [n_slots], HEADER_DTYPE
    prompts: np.ndarray        # [n_slots, max_prompt_tokens] int32
    outputs: np.ndarray        # [n_slots, max_output_tokens] int32
    logprobs: np.ndarray | None  # [n_slots, max_output_tokens] float32
    prefix_keys: np.ndarray | None = None  # [n_slots, prefix_key_pages] uint64 (only if geometry.prefix_page_size)
    logit_bias: np.ndarray | None = None   # [n_slots, max_logit_bias] PAIR_DTYPE (only if geometry.max_logit_bias)
    top_logprobs: np.ndarray | None = None  # [n_slots, max_output_tokens, max_top_logprobs] PAIR_DTYPE (or None)
    grammars: np.ndarray | None = None      # [max_grammar_bytes // 4] int32 (only if geometry.max_grammar_bytes)
    stop_token_ids: np.ndarray | None = None  # [n_slots, max_stop_ids] int32 (only if geometry.max_stop_ids)


class RingLayout:
    """Byte offsets of every region and slot for one geometry."""

    def __init__(self, geometry: RingGeometry):
        g = self.geometry = geometry
        self.status_dtype = status_dtype(g.n_slots)
        self.prompt_stride = 4 * g.max_prompt_tokens
        self.stop_stride = TOKEN_DTYPE.itemsize * g.max_stop_ids
        self.output_stride = 4 * g.max_output_tokens
        self.prefix_key_stride = 8 * g.prefix_key_pages
        self.logit_bias_stride = PAIR_DTYPE.itemsize * g.max_logit_bias
        self.top_logprobs_stride = PAIR_DTYPE.itemsize * g.max_output_tokens * g.max_top_logprobs
        self.grammar_words = g.max_grammar_bytes // 4
        offset = 0
        sizes = [("control", CONTROL_DTYPE.itemsize), ("status", self.status_dtype.itemsize),
                 ("headers", g.n_slots * HEADER_DTYPE.itemsize), ("stop_token_ids", g.n_slots * self.stop_stride),
                 ("prompts", g.n_slots * self.prompt_stride),
                 ("prefix_keys", g.n_slots * self.prefix_key_stride),
                 ("logit_bias", g.n_slots * self.logit_bias_stride),
                 ("grammars", self.grammar_words * 4),
                 ("outputs", g.n_slots * self.output_stride),
                 ("logprobs", g.n_slots * self.output_stride if g.logprobs else 0),
                 ("top_logprobs", g.n_slots * self.top_logprobs_stride)]
        self.regions: dict[str, tuple[int, int]] = {}
        for name, size in sizes:
            self.regions[name] = (offset, size)
            offset = _round_up(offset + size, REGION_ALIGN)
        self.size = offset

    def offset(self, region: str) -> int:
        return self.regions[region][0]

    # Per-slot byte offsets, used by transports that only do write(offset, data) / read(offset, nbytes).
    def status_at(self, column: str, slot: int) -> int:
        return self.offset("status") + self.status_dtype.fields[column][1] + 4 * slot

    def header_at(self, slot: int) -> int:
        return self.offset("headers") + slot * HEADER_DTYPE.itemsize

    def stop_token_ids_at(self, slot: int) -> int:
        return self.offset("stop_token_ids") + slot * self.stop_stride

    def prompt_at(self, slot: int) -> int:
        return self.offset("prompts") + slot * self.prompt_stride

    def prefix_keys_at(self, slot: int) -> int:
        return self.offset("prefix_keys") + slot * self.prefix_key_stride

    def logit_bias_at(self, slot: int) -> int:
        return self.offset("logit_bias") + slot * self.logit_bias_stride

    def grammar_at(self, word: int) -> int:
        """Word ``word`` of the grammars region."""
        return self.offset("grammars") + 4 * word

    def top_logprobs_at(self, slot: int, index: int = 0) -> int:
        """The first of output position ``index``'s ``max_top_logprobs`` pairs."""
        return (self.offset("top_logprobs") + slot * self.top_logprobs_stride
                + index * PAIR_DTYPE.itemsize * self.geometry.max_top_logprobs)

    def output_at(self, slot: int, index: int = 0) -> int:
        return self.offset("outputs") + slot * self.output_stride + 4 * index

    def logprob_at(self, slot: int, index: int = 0) -> int:
        if not self.geometry.logprobs:
            raise ValueError("this ring has no logprobs area: build it with RingGeometry(logprobs=True)")
        return self.offset("logprobs") + slot * self.output_stride + 4 * index

    def control_bytes(self) -> bytes:
        """The control block of a fresh ring: identity and geometry set, every counter zero."""
        return control.fresh(self.geometry)

    def verify(self, control_block: bytes) -> None:
        """Raise ``RingMismatch`` naming the first field of ``control_block`` that this layout does not expect."""
        control.verify(control_block, self.geometry)

    def initialise(self, memory) -> None:
        """Write a fresh control block at the start of ``memory`` (a ``RemoteMemory`` of at least ``size`` bytes)."""
        memory.write(0, self.control_bytes())

    def view(self, buffer) -> RingView:
        """Numpy views over ``buffer`` (any writable object exporting the buffer protocol, at least ``size`` bytes)."""
        g = self.geometry

        def region(name, dtype, shape):
            offset, _ = self.regions[name]
            count = int(np.prod(shape))
            return np.frombuffer(buffer, dtype, count=count, offset=offset).reshape(shape)

        return RingView(
            control=region("control", CONTROL_DTYPE, (1,)),
            status=region("status", self.status_dtype, (1,))[0],
            headers=region("headers", HEADER_DTYPE, (g.n_slots,)),
            prompts=region("prompts", TOKEN_DTYPE, (g.n_slots, g.max_prompt_tokens)),
            outputs=region("outputs", TOKEN_DTYPE, (g.n_slots, g.max_output_tokens)),
            logprobs=region("logprobs", np.dtype("<f4"), (g.n_slots, g.max_output_tokens)) if g.logprobs else None,
            prefix_keys=(region("prefix_keys", np.dtype("<u8"), (g.n_slots, g.prefix_key_pages))
                         if g.prefix_page_size else None),
            logit_bias=region("logit_bias", PAIR_DTYPE, (g.n_slots, g.max_logit_bias)) if g.max_logit_bias else None,
            top_logprobs=(region("top_logprobs", PAIR_DTYPE, (g.n_slots, g.max_output_tokens, g.max_top_logprobs))
                          if g.max_top_logprobs else None),
            grammars=region("grammars", np.dtype("<i4"), (self.grammar_words,)) if self.grammar_words else None,
            stop_token_ids=(region("stop_token_ids", TOKEN_DTYPE, (g.n_slots, g.max_stop_ids))
                            if g.max_stop_ids else None),
        )
