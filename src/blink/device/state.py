"""The scheduler's memory: every array one iteration touches and the word indices into them.

``SchedulerArrays`` groups the ring (views of the region the agent writes), the step buffers (``step.py``) and the
scheduler's own state in device memory. The same tuple is built from numpy arrays for the CPU simulator and from
device addresses on the GPU (``launch.py``), so kv, batcher and scheduler code never knows which it runs on.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from blink.device.config import MAX_EOS, MAX_SEQS, SchedulerConfig
from blink.device.step import StepLayout
from blink.ring.control import word_index
from blink.ring.layout import RingView, header_dtype


def _names(*names: str) -> range:
    """Consecutive word indices 0, 1, ... for ``names`` (the names document what each index holds)."""
    return range(len(names))


# Scheduler scalars (s.sched, int32).
SCHED_NAMES = ("running", "free_top", "rows", "bucket", "queued", "queue_head", "consumed", "pending_finished",
               "publishable")
N_RUNNING, FREE_TOP, N_ROWS, BUCKET, N_QUEUED, QUEUE_HEAD, N_CONSUMED, N_PENDING_FINISHED, N_PUBLISHABLE = \
    _names(*SCHED_NAMES)
SCHED_WORDS = len(SCHED_NAMES)

IDLE = -1       # nothing to run: back off, then iterate again
STOP = -2       # shutdown done: do not relaunch

# Scheduler configuration words (s.cfg).
CFG_NAMES = ("page_size", "token_budget", "max_num_seqs", "n_buckets", "n_eos", "watermark", "max_model_len",
             "logprobs", "max_stop")
CFG_PAGE_SIZE, CFG_TOKEN_BUDGET, CFG_MAX_NUM_SEQS, CFG_N_BUCKETS, CFG_N_EOS, CFG_WATERMARK, CFG_MAX_MODEL_LEN, \
    CFG_LOGPROBS, CFG_MAX_STOP = _names(*CFG_NAMES)
CFG_WORDS = len(CFG_NAMES)

# Control-block words, as indices into the u32 (C32_*) and u64 (C64_*) views of the block.
C32_SHUTDOWN, C32_ENGINE_STATE, C32_IN_STEP = (word_index(n, 4) for n in ("shutdown", "engine_state", "in_step"))
C32_KV_TOTAL, C32_KV_FREE, C32_RUNNING, C32_WAITING = (word_index(n, 4) for n in
                                                      ("kv_pages_total", "kv_pages_free", "running", "waiting"))
C64_HEARTBEAT, C64_STEPS, C64_TOKENS, C64_ADMITTED, C64_FINISHED, C64_CANCELLED, C64_PREEMPTED = (
    word_index(n, 8) for n in ("heartbeat", "steps", "tokens", "admitted", "finished", "cancelled", "preempted"))
C64_SUBMITTED, C64_CANCELS = word_index("submitted", 8), word_index("cancels", 8)
COUNTERS = (C64_HEARTBEAT, C64_STEPS, C64_TOKENS, C64_ADMITTED, C64_FINISHED, C64_CANCELLED, C64_PREEMPTED)

# s.stats (int64): first the device copies of the control block's u64 words (same indices as C64_*), then the SM
# cycles spent in each phase of the iteration, summed over iterations (thread 0's clock), then the doorbell counts
# the scheduler has acted on.
PROFILE_PHASES = ("doorbells", "consume", "retire", "collect", "admit", "plan", "publish")
P_FIRST = max(*COUNTERS, C64_SUBMITTED, C64_CANCELS) + 1
P_DOORBELLS, P_CONSUME, P_RETIRE, P_COLLECT, P_ADMIT, P_PLAN, P_PUBLISH = (P_FIRST + k for k in
                                                                           _names(*PROFILE_PHASES))
S_SEEN_SUBMITTED = P_FIRST + len(PROFILE_PHASES)
S_SEEN_CANCELS = S_SEEN_SUBMITTED + 1
STATS_WORDS = S_SEEN_CANCELS + 1

# s.doorbells (int64): the words the resident loop read across PCIe while the last step ran (shim.cu), for the next
# iteration; ``valid`` says they are fresh.
DOORBELL_NAMES = ("valid", "shutdown", "submitted", "cancels")
DB_VALID, DB_SHUTDOWN, DB_SUBMITTED, DB_CANCELS = _names(*DOORBELL_NAMES)


def _header_word(name: str, size: int) -> int:
    offset = header_dtype(1).fields[name][1]    # the fixed part of the header does not depend on the geometry
    assert offset % size == 0
    return offset // size


# Header words, as indices into the i32 / f32 (H32_*, HF_*) and u64 (H64_*) views of a header.
H64_REQUEST_ID, H64_ARRIVAL, H64_SEED = (_header_word(n, 8) for n in ("request_id", "arrival_ns", "seed"))
H32_PROMPT_LEN, H32_MAX_TOKENS, H32_TOP_K, H32_FLAGS, H32_N_STOP, H32_PRIORITY, H32_STOP_IDS = (
    _header_word(n, 4) for n in ("prompt_len", "max_tokens", "top_k", "flags", "n_stop", "priority", "stop_ids"))
HF_TEMPERATURE, HF_TOP_P = _header_word("temperature", 4), _header_word("top_p", 4)

# Shared-memory scratch sizes (compile-time constants).
MAX_CANDIDATES = 1024
assert MAX_CANDIDATES >= MAX_SEQS + 1


class SchedulerArrays(NamedTuple):
    """Every array one iteration touches. Field order is the order of the device address table (launch.py)."""

    # The ring (views of the region the agent writes).
    ctl32: object           # u32 [64]    control block
    ctl64: object           # u64 [32]    control block
    state: object           # u32 [n]     status columns
    epoch: object
    cancel: object
    finish: object
    ngen: object
    hdr_i32: object         # i32 [n, H/4] request headers
    hdr_f32: object         # f32 [n, H/4]
    hdr_u64: object         # u64 [n, H/8]
    prompts: object         # i32 [n, max_prompt_tokens]
    outputs: object         # i32 [n, max_output_tokens]
    logprobs: object        # f32 [n, max_output_tokens] (or [n, 1] when the ring has no logprobs area)
    # Step inputs and outputs (StepBuffers).
    num_seqs: object
    token_ids: object
    positions: object
    slot_mapping: object
    query_start_loc: object
    seq_lens: object
    block_tables: object
    logits_indices: object
    temperature: object
    top_p: object
    top_k: object
    seed: object
    sampled_ids: object
    sampled_logprobs: object
    # Scheduler state (device memory only).
    sched: object           # i32 [SCHED_WORDS]  N_RUNNING, FREE_TOP, N_ROWS, BUCKET, N_QUEUED, QUEUE_HEAD
    stats: object           # i64 [STATS_WORDS]  device copies of the control block's u64 counters, doorbells seen
    cfg: object             # i32 [CFG_WORDS]
    buckets: object         # i32 [n_buckets]
    eos_ids: object         # i32 [MAX_EOS]
    free_pages: object      # i32 [num_pages]   free stack
    seq_pages: object       # i32 [n, max_pages_per_seq]   block table per ring slot
    seq_npages: object      # i32 [n]
    seq_computed: object    # i32 [n]  tokens whose K/V are in the cache
    seq_total: object       # i32 [n]  prompt + generated tokens
    seq_prompt_len: object  # i32 [n]
    seq_max_tokens: object  # i32 [n]
    seq_flags: object       # i32 [n]
    seq_last: object        # i32 [n]  last generated token
    seq_version: object     # i32 [n]  bumped whenever the block table restarts (admission, preemption)
    seq_finish: object      # i32 [n]  finish reason decided by consume, acted on by retire
    seq_top_k: object       # i32 [n]
    seq_n_stop: object      # i32 [n]
    seq_stop: object        # i32 [n, max_stop_ids or 1]
    seq_temperature: object  # f32 [n]
    seq_top_p: object       # f32 [n]
    seq_seed: object        # i64 [n]
    seq_seen: object        # i32 [n]  a READY slot the scheduler holds: QUEUED or REFUSED (0: none; see below)
    queue_slots: object     # i32 [n]  the waiting queue (waiting.py), sorted by (key, slot)
    queue_keys: object      # i64 [n]
    queue_tmp_slots: object  # i32 [n] scratch for merging
    queue_tmp_keys: object  # i64 [n]
    running: object         # i32 [max_num_seqs]  ring slots, in admission order
    consumed: object        # i32 [max_num_seqs]  slot whose token row r of the last step delivered (-1: none)
    pending_finished: object  # i32 [n]  finished slots whose FINISHED state is not yet published (each at most once)
    doorbells: object       # i64 [DOORBELL_NAMES]  prefetched by the resident loop (DB_*)
    row_slot: object        # i32 [max_num_seqs]  ring slot of each row of the last planned step
    row_version: object     # i32 [max_num_seqs]  seq_version of that slot when the row was last written
    row_pages: object       # i32 [max_num_seqs]  block-table entries already copied into that row


class Scratch(NamedTuple):
    """Shared-memory work arrays of one iteration, by role (each phase's docstring says what it keeps in which).

    ``slots``: the ring slots a phase works on (finishing, a preemption victim, new candidates); ``keys``: their
    int64 sort keys, or per step row the first block-table entry it still lacks; ``rank``: a 0/1 flag per running
    sequence, scanned into its rank among the flagged ones (finishing; having a chunk = its step row); ``pages``:
    page counts per item, scanned into offsets (pages to free, to allocate, to copy into a row's block table);
    ``tokens``: token counts per running sequence, scanned into offsets (tokens wanted before it, its first token
    row); ``chunk``: the tokens each running sequence gets in the planned step; ``kept``: the running list being
    compacted; ``partial``: per-warp partial sums of the block scans; ``counters``: the iteration's K_* counters.
    """

    slots: object       # i32 [MAX_CANDIDATES]
    keys: object        # i64 [MAX_CANDIDATES]
    rank: object        # i32 [MAX_CANDIDATES]
    pages: object
    tokens: object
    chunk: object
    kept: object
    partial: object     # i32 [MAX_THREADS]
    counters: object    # i32 [N_COUNTERS]


# seq_seen values. QUEUED: the slot waits in the queue. REFUSED: finished while READY (cancelled or unservable),
# its FINISHED state not yet published; the slot stays READY in the ring until then and no scan may take it again.
QUEUED, REFUSED = 1, 2

# Scratch counters (sh.counters), zeroed at the start of each iteration.
COUNTER_NAMES = ("tokens", "finished", "cancelled", "new", "admitted", "rejected", "preempted", "victim", "shutdown",
                 "scan", "cancel_bell", "ending", "prefills", "decode_pages", "need", "copies", "chunked", "refused")
K_TOKENS, K_FINISHED, K_CANCELLED, K_NEW, K_ADMITTED, K_REJECTED, K_PREEMPTED, K_VICTIM, K_SHUTDOWN, K_SCAN, \
    K_CANCEL_BELL, K_ENDING, K_PREFILLS, K_DECODE_PAGES, K_NEED, K_COPIES, K_CHUNKED, K_REFUSED = \
    _names(*COUNTER_NAMES)
N_COUNTERS = len(COUNTER_NAMES)


# -- host side: the arrays of one scheduler ----------------------------------------------------------------------


def ring_arrays(view: RingView) -> dict[str, np.ndarray]:
    """The ring fields of ``SchedulerArrays`` as numpy views of the ring region."""
    n = view.headers.shape[0]
    raw_headers = view.headers.view(np.uint8).reshape(n, -1)
    logprobs = view.logprobs if view.logprobs is not None else np.zeros((n, 1), np.float32)
    control = view.control.view(np.uint8).reshape(-1)
    return dict(ctl32=control.view(np.uint32), ctl64=control.view(np.uint64), state=view.status["state"],
                epoch=view.status["epoch"], cancel=view.status["cancel"], finish=view.status["finish_reason"],
                ngen=view.status["n_generated"], hdr_i32=raw_headers.view(np.int32),
                hdr_f32=raw_headers.view(np.float32), hdr_u64=raw_headers.view(np.uint64), prompts=view.prompts,
                outputs=view.outputs, logprobs=logprobs)


def state_arrays(config: SchedulerConfig, n_slots: int, max_stop_ids: int, has_logprobs: bool,
                 step: StepLayout) -> dict[str, np.ndarray]:
    """Fresh scheduler state: every page free, nothing running."""
    if step.max_num_seqs < config.max_num_seqs or step.max_num_batched_tokens < config.buckets[-1]:
        raise ValueError(f"StepLayout {step} is smaller than SchedulerConfig needs (max_num_seqs "
                         f"{config.max_num_seqs}, largest bucket {config.buckets[-1]})")
    if step.max_pages_per_seq < config.max_pages_per_seq:
        raise ValueError(f"StepLayout.max_pages_per_seq {step.max_pages_per_seq} < {config.max_pages_per_seq} "
                         "(max_model_len / page_size)")
    cfg = np.zeros(CFG_WORDS, np.int32)
    cfg[CFG_PAGE_SIZE] = config.page_size
    cfg[CFG_TOKEN_BUDGET] = config.max_num_batched_tokens
    cfg[CFG_MAX_NUM_SEQS] = config.max_num_seqs
    cfg[CFG_N_BUCKETS] = len(config.buckets)
    cfg[CFG_N_EOS] = len(config.eos_token_ids)
    cfg[CFG_WATERMARK] = config.watermark_pages
    cfg[CFG_MAX_MODEL_LEN] = config.max_model_len
    cfg[CFG_LOGPROBS] = int(has_logprobs)
    cfg[CFG_MAX_STOP] = max_stop_ids
    sched = np.zeros(SCHED_WORDS, np.int32)
    sched[FREE_TOP] = config.num_pages
    sched[BUCKET] = IDLE
    eos = np.zeros(MAX_EOS, np.int32)
    eos[:len(config.eos_token_ids)] = config.eos_token_ids
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return dict(
        sched=sched, stats=np.zeros(STATS_WORDS, np.int64), cfg=cfg, buckets=np.array(config.buckets, np.int32),
        eos_ids=eos,
        free_pages=np.arange(config.num_pages, dtype=np.int32),
        seq_pages=i32(n_slots, config.max_pages_per_seq), seq_npages=i32(n_slots), seq_computed=i32(n_slots),
        seq_total=i32(n_slots), seq_prompt_len=i32(n_slots), seq_max_tokens=i32(n_slots), seq_flags=i32(n_slots),
        seq_last=i32(n_slots), seq_version=i32(n_slots), seq_finish=i32(n_slots), seq_top_k=i32(n_slots),
        seq_n_stop=i32(n_slots),
        seq_stop=i32(n_slots, max(max_stop_ids, 1)), seq_temperature=np.zeros(n_slots, np.float32),
        seq_top_p=np.ones(n_slots, np.float32), seq_seed=np.zeros(n_slots, np.int64), seq_seen=i32(n_slots),
        queue_slots=i32(n_slots), queue_keys=np.zeros(n_slots, np.int64), queue_tmp_slots=i32(n_slots),
        queue_tmp_keys=np.zeros(n_slots, np.int64),
        running=i32(config.max_num_seqs), consumed=i32(config.max_num_seqs),
        pending_finished=i32(n_slots), doorbells=np.zeros(len(DOORBELL_NAMES), np.int64),
        row_slot=np.full(config.max_num_seqs, -1, np.int32),
        row_version=i32(config.max_num_seqs), row_pages=i32(config.max_num_seqs))


def control_gauges(ctl32: np.ndarray, config: SchedulerConfig) -> None:
    """Host, before the first iteration: gauges that never change."""
    ctl32[C32_KV_TOTAL] = config.num_pages
    ctl32[C32_KV_FREE] = config.num_pages


