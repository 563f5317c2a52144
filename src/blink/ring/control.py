"""The ring's control block (384 B at offset 0): identity, geometry, the shutdown word, the GPU side's state and
counters, the agent's doorbells. The one place that encodes, decodes and checks it.

Writers: the creator (identity, geometry and the prefix-key seed, once), the host or the agent (``shutdown``, the
doorbells: by every agent of the ring, each value new, ``blink.ring.shares``), the GPU side (everything else).
``fresh`` builds the block of a new ring, ``verify`` checks an existing one against a geometry, ``geometry_of``
reads the geometry an existing ring was created with, ``read`` decodes the words of a live ring,
``request_shutdown`` writes the shutdown word.
"""
from __future__ import annotations

import os
import secrets

import numpy as np

from blink.ring.errors import RingMismatch
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS, RingGeometry

MAGIC = 0x4B4E4C42  # "BLNK" in little-endian bytes
VERSION = 9

# Control block flags.
RING_LOGPROBS = 1

# Engine states (engine_state, written by the GPU side). ENGINE_ELSEWHERE is the creator's mark on the host copy of a
# ring whose request side the engine keeps in GPU memory: nothing reads what is written into that copy, so agents
# that open it (by its shared-memory name) are refused and pointed to the engine's listener.
ENGINE_STARTING, ENGINE_SERVING, ENGINE_STOPPED, ENGINE_ELSEWHERE = 0, 1, 2, 3

# The engine process bumps ``alive`` this often; a reader's liveness timeout must be a few of these.
ALIVE_TICK_S = 0.25


def struct(fields: list[tuple[str, object, int]], itemsize: int) -> np.dtype:
    """A little-endian structured dtype with the byte offsets spelled out: the offsets ARE the contract. Every field
    lies on its own alignment (numpy checks), and the dtype says so: numba's record type then loads and stores each
    field as one word (the GPU scheduler reads the control block and the headers as records)."""
    names = [f[0] for f in fields]
    formats = [f[1] for f in fields]
    offsets = [f[2] for f in fields]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize, "aligned": True})


CONTROL_DTYPE = struct([
    ("magic", "<u4", 0),
    ("version", "<u4", 4),
    ("n_slots", "<u4", 8),
    ("max_prompt_tokens", "<u4", 12),
    ("max_output_tokens", "<u4", 16),
    ("max_stop_ids", "<u4", 20),
    ("flags", "<u4", 24),
    ("shutdown", "<u4", 28),        # host or agent: ask the GPU loop to end
    ("engine_state", "<u4", 32),    # GPU: ENGINE_STARTING / SERVING / STOPPED
    ("launch_error", "<i4", 36),    # GPU: first failing device-side cudaGraphLaunch code, 0 if none
    ("heartbeat", "<u8", 40),       # GPU: +1 per scheduler iteration
    ("steps", "<u8", 48),           # GPU: model steps launched
    ("tokens", "<u8", 56),          # GPU: tokens generated
    ("admitted", "<u8", 64),        # GPU: requests moved READY -> RUNNING
    ("finished", "<u8", 72),        # GPU: requests moved to FINISHED (any reason)
    ("cancelled", "<u8", 80),       # GPU: requests finished with reason abort
    ("preempted", "<u8", 88),       # GPU: recompute preemptions
    ("kv_pages_total", "<u4", 96),  # GPU gauges
    ("kv_pages_free", "<u4", 100),
    ("running", "<u4", 104),
    ("waiting", "<u4", 108),
    # The agents' doorbells, each written after the words it announces. The GPU acts when one differs from the value
    # it last acted on, so every value written is new: one agent writes its count of writes (requests published
    # READY, cancel words written); agent i of N writes count * N + i (blink.ring.shares: the contract).
    ("submitted", "<u8", 112),      # agent doorbell: READY states published
    ("cancels", "<u8", 120),        # agent doorbell: cancel words written
    ("max_model_len", "<u4", 128),  # creator: the engine's limit on prompt + output positions of one sequence
    ("in_step", "<u4", 132),        # engine: 1 while the loop does host work (the CPU backend's iteration + step)
    ("step_limit_s", "<u4", 136),   # engine: the longest a step may take on this backend before it counts as hung
    ("alive", "<u8", 144),          # engine process: +1 every ALIVE_TICK_S while it lives (0: nobody ticks)
    ("creator_pid", "<u4", 152),    # creator: its process id, so an agent attaches only to its own engine's ring
    ("prefix_page_size", "<u4", 156),   # creator: tokens per page of the prompt keys (0: no keys; geometry)
    ("prefix_seed", "<u8", 160),    # creator: the seed of every prefix key of this ring (blink.ring.hashing)
    ("prefix_query_tokens", "<u8", 168),    # GPU: prompt tokens of admitted requests (prefix cache lookups)
    ("prefix_hit_tokens", "<u8", 176),  # GPU: of those, tokens whose K/V came from the prefix cache
    ("prefix_evictions", "<u8", 184),   # GPU: cached pages evicted for reuse
    ("prefill_tokens", "<u8", 192),     # GPU: prompt positions the model computed (preemption recomputes)
    ("cached_pages", "<u4", 200),   # GPU gauge: pages in the prefix cache (in use or evictable)
    ("max_logit_bias", "<u4", 204),     # creator: (token, bias) pairs per request (geometry)
    ("max_top_logprobs", "<u4", 208),   # creator: top logprobs per output position (geometry)
    ("vocab_size", "<u4", 212),     # creator: the tokens the grammars' masks cover (geometry)
    ("secret_digest", "<u8", 216),  # creator: a digest of the secret its agents are given (blink.ring.secret)
    ("max_grammar_bytes", "<u4", 224),  # creator: the grammars region's size (geometry)
    ("num_speculative_tokens", "<u4", 228),     # engine: drafts per sequence and step it verifies (0: none)
    ("spec_drafts", "<u8", 232),    # GPU: sequence-steps that verified drafts (speculative decoding)
    ("spec_draft_tokens", "<u8", 240),  # GPU: draft tokens verified
    ("spec_accepted_tokens", "<u8", 248),   # GPU: of those, drafts the sequence's own tokens confirmed
    # GPU: of those, the ones at each draft position (the first draft of a step at 0): vLLM's per-position counter
    ("spec_accepted_per_pos", ("<u8", (MAX_SPECULATIVE_TOKENS,)), 256),
], 384)

WORDS = tuple(name for name in CONTROL_DTYPE.names if name != "secret_digest")    # what ``read`` shows
GEOMETRY_FIELDS = ("n_slots", "max_prompt_tokens", "max_output_tokens", "max_stop_ids", "flags", "max_model_len",
                   "prefix_page_size", "max_logit_bias", "max_top_logprobs", "max_grammar_bytes", "vocab_size")


def offset_of(name: str) -> int:
    """Byte offset of a control-block field."""
    return CONTROL_DTYPE.fields[name][1]


def geometry_words(geometry: RingGeometry) -> dict[str, int]:
    """The control-block words that record ``geometry``."""
    g = geometry
    return {"n_slots": g.n_slots, "max_prompt_tokens": g.max_prompt_tokens, "max_output_tokens": g.max_output_tokens,
            "max_stop_ids": g.max_stop_ids, "flags": RING_LOGPROBS if g.logprobs else 0,
            "max_model_len": g.max_model_len, "prefix_page_size": g.prefix_page_size,
            "max_logit_bias": g.max_logit_bias, "max_top_logprobs": g.max_top_logprobs,
            "max_grammar_bytes": g.max_grammar_bytes, "vocab_size": g.vocab_size}


def fresh(geometry: RingGeometry, secret_digest: int = 0) -> bytes:
    """The control block of a new ring, created by this process: identity and geometry set, a random prefix-key
    seed, the digest of its agents' secret (0: none), every counter zero."""
    block = np.zeros(1, CONTROL_DTYPE)
    block["magic"] = MAGIC
    block["version"] = VERSION
    block["creator_pid"] = os.getpid()
    block["secret_digest"] = secret_digest
    block["prefix_seed"] = secrets.randbits(64)
    for name, value in geometry_words(geometry).items():
        block[name] = value
    return block.tobytes()


def decode(raw: bytes) -> np.void:
    """The control block at the start of ``raw`` as a record (``RingMismatch`` if ``raw`` is too short)."""
    if len(raw) < CONTROL_DTYPE.itemsize:
        raise RingMismatch(f"control block is {len(raw)} bytes, expected {CONTROL_DTYPE.itemsize}")
    return np.frombuffer(raw, CONTROL_DTYPE, count=1)[0]


def _check_identity(block: np.void) -> None:
    if int(block["magic"]) != MAGIC:
        raise RingMismatch(f"ring field 'magic' is {int(block['magic']):#x}, expected {MAGIC:#x}: this region "
                           "is not a blink ring or was never initialised")
    if int(block["version"]) != VERSION:
        raise RingMismatch(f"ring field 'version' is {int(block['version'])} in the region but {VERSION} in this "
                           "blink: run the agent and the engine from the same blink version")


def verify(raw: bytes, geometry: RingGeometry) -> None:
    """Raise ``RingMismatch`` naming the first field of the control block in ``raw`` that ``geometry`` does not
    expect, or saying that ``raw`` comes from a copy its engine does not serve (``ENGINE_ELSEWHERE``)."""
    block = decode(raw)
    _check_identity(block)
    if int(block["engine_state"]) == ENGINE_ELSEWHERE:
        raise RingMismatch("this copy of the ring is not the one its engine serves: the engine keeps the ring's "
                           "request side in GPU memory; attach through the engine's listener (blink agent --remote "
                           "HOST:PORT --transport ipc on its host, rdma elsewhere)")
    for name, want in geometry_words(geometry).items():
        got = int(block[name])
        if got != want:
            raise RingMismatch(f"ring field '{name}' is {got} in the region but {want} in this RingLayout: "
                               "build the agent and the engine from the same RingGeometry")


def geometry_of(raw: bytes) -> RingGeometry:
    """The geometry an existing ring was created with (``RingMismatch`` if it is not an initialised blink ring)."""
    block = decode(raw)
    _check_identity(block)
    return RingGeometry(n_slots=int(block["n_slots"]), max_prompt_tokens=int(block["max_prompt_tokens"]),
                        max_output_tokens=int(block["max_output_tokens"]), max_stop_ids=int(block["max_stop_ids"]),
                        logprobs=bool(int(block["flags"]) & RING_LOGPROBS),
                        max_model_len=int(block["max_model_len"]), prefix_page_size=int(block["prefix_page_size"]),
                        max_logit_bias=int(block["max_logit_bias"]), max_top_logprobs=int(block["max_top_logprobs"]),
                        max_grammar_bytes=int(block["max_grammar_bytes"]), vocab_size=int(block["vocab_size"]))


def read(memory) -> dict[str, int | tuple[int, ...]]:
    """Every control-block word of the ring in ``memory`` (a ``RemoteMemory``), by name, in one read (an array field
    as a tuple); not the secret's digest (``WORDS``): the stats go to logs and /metrics."""
    block = decode(memory.read(0, CONTROL_DTYPE.itemsize))
    return {name: tuple(map(int, block[name])) if np.ndim(block[name]) else int(block[name]) for name in WORDS}


def write(memory, name: str, value: int) -> None:
    """Store one control-block word (in its own type) into the ring in ``memory``."""
    memory.write(offset_of(name), np.array([value], CONTROL_DTYPE.fields[name][0]).tobytes())


def request_shutdown(memory) -> None:
    """Ask the GPU side to finish everything in flight with "abort" and stop its loop."""
    write(memory, "shutdown", 1)
