"""The scheduler's memory: every array one iteration touches, and the records and index names it is read by.

``SchedulerArrays`` groups the ring (views of the region the agent writes), the step buffers (``step.py``), the
step's token history and the scheduler's own state in device memory. The same tuple is built from numpy arrays for
the CPU simulator and from device addresses on the GPU (``image.py``, ``runtime.py``), so kv, batcher and scheduler
code never knows which it runs on.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from blink.device.config import MAX_SEQS
from blink.device.step import N_PENALTIES
from blink.ring.control import CONTROL_DTYPE
from blink.ring.geometry import MAX_SPECULATIVE_TOKENS
from blink.ring.layout import HEADER_DTYPE


def record(dtype) -> np.dtype:
    """``dtype`` as numpy's record type: an element reads its fields as attributes (``sched[0].running``) in plain
    numpy too, as device code does (the CUDA simulator runs it on plain arrays)."""
    return np.dtype((np.record, dtype))


def _record(dtype: str, *names: str) -> np.dtype:
    """An aligned record of ``names``, each a ``dtype`` (aligned: numba loads and stores each field as one word)."""
    return record(np.dtype([(name, dtype) for name in names], align=True))


def indices(names: type) -> tuple:
    """An instance of NamedTuple class ``names`` whose fields hold their own positions: array indices by name, for
    the arrays that must stay arrays (``cuda.atomic`` takes an array and an index). numba folds them as constants;
    an ``IntEnum`` member is no array index to it."""
    return names(*range(len(names._fields)))


# Scheduler scalars (s.sched[0]). The prefix cache's (kv.py, prefix.py): evictable = cached pages no sequence holds
# (free pages = the free stack + these), cached = pages in the table, lru_head / lru_count = the LRU ring. What one
# part of an iteration leaves for another (scheduler.py): admitted = requests the last prepare admitted (the last
# ``admitted`` of the running list; settle publishes them RUNNING); shutdown = settle saw one (the next prepare acts
# on it); cancel_bell = settle saw the ``cancels`` doorbell move (the next retire looks at running requests' cancels).
SCHED_DTYPE = _record("<i4", "running", "free_top", "rows", "bucket", "queued", "queue_head", "consumed",
                      "pending_finished", "publishable", "evictable", "cached", "lru_head", "lru_count", "admitted",
                      "shutdown", "cancel_bell")

# The parts of an iteration (scheduler.py), as flags; one call runs those it names in the order COLLECT, PREPARE,
# PUBLISH, SETTLE, WATCH. The GPU's resident loop calls PREPARE, launches the step, then calls SETTLE (PUBLISH then
# COLLECT as one part, the doorbells read beside publish's fence) while it runs, and when idle, WATCH (alone: the
# doorbells read, nothing written) until one moves; the tail loop and the simulator call ITERATION, then run the step.
PREPARE, PUBLISH, COLLECT, SETTLE, WATCH = 1, 2, 4, 8, 16
ITERATION = COLLECT | PREPARE | PUBLISH
# What an iteration returns besides a bucket index.
IDLE = -1       # nothing to run: back off, then iterate again
STOP = -2       # shutdown done: do not relaunch
AGAIN = -3      # COLLECT or SETTLE: the next iteration has work without a doorbell moving (requests queued, finished
                # requests to publish, a shutdown): iterate again without backing off; WATCH: a doorbell moved

# Scheduler configuration (s.cfg[0]).
CFG_DTYPE = _record("<i4", "page_size", "token_budget", "max_num_seqs", "n_buckets", "n_eos", "watermark",
                    "max_model_len", "logprobs", "max_stop", "prefix_caching", "max_logit_bias", "max_top_logprobs",
                    "grammar_words", "mask_words", "spec_tokens", "spec_min", "spec_max", "disable_by_batch_size")

# The ring's control block as device code sees it: CONTROL_DTYPE's fields (s.control[0].kv_pages_free).
CONTROL_RECORD = record(CONTROL_DTYPE)


class Phases(NamedTuple):
    """The phases of an iteration in the order the resident loop runs them (prepare's, then settle's), as indices
    into ``s.stats[0].profile``."""

    consume: int
    retire: int
    admit: int
    chunks: int         # the plan: who runs, how many tokens (the steady state's test, or chunks, drafts, preemption)
    pages: int          # the plan: the pages the step's tokens lack, allocated
    inputs: int         # the plan: the step's rows, block tables and tokens written, the bucket chosen
    publish: int
    doorbells: int
    collect: int        # the scan, each new request's header and key, the grammar placements it follows
    enqueue: int        # the new keys sorted and merged into the waiting queue


PHASE = indices(Phases)
PROFILE_PHASES = Phases._fields
N_PHASES = len(PROFILE_PHASES)
SETTLE_PHASES = PROFILE_PHASES[PHASE.publish:]      # off the step's critical path in the resident loop

# s.stats[0]: the device copies of the control block's counters (named as there; publish_stats stores them into the
# ring), the prefix-key seed, the SM cycles spent in each phase of the iteration summed over iterations (thread 0's
# clock), and the doorbell values the scheduler has acted on.
PUBLISHED_COUNTERS = ("heartbeat", "steps", "tokens", "admitted", "finished", "cancelled", "preempted",
                      "prefix_query_tokens", "prefix_hit_tokens", "prefix_evictions", "prefill_tokens", "spec_drafts",
                      "spec_draft_tokens", "spec_accepted_tokens")
STATS_DTYPE = record(np.dtype([*((name, "<i8") for name in PUBLISHED_COUNTERS), ("prefix_seed", "<u8"),
                               ("profile", "<i8", (N_PHASES,)),
                               ("spec_accepted_per_pos", "<i8", (MAX_SPECULATIVE_TOKENS,)), ("seen_submitted", "<i8"),
                               ("seen_cancels", "<i8")], align=True))
assert all(CONTROL_DTYPE.fields[name][0] == np.dtype("<u8") for name in PUBLISHED_COUNTERS)


# The ring's request headers as device code sees them: HEADER_DTYPE's fields (s.headers[slot].temperature).
HEADER_RECORD = record(HEADER_DTYPE)
# Plain numpy reads a record's attribute before its field of the same name (``record.flags`` is numpy's): the
# records device code reads by attribute have no such field (the control block's geometry ``flags`` it never reads).
assert not any(set(dtype.names) & set(dir(np.record)) for dtype in (SCHED_DTYPE, CFG_DTYPE, STATS_DTYPE,
                                                                    HEADER_RECORD))
# The penalties of a row of ``penalties`` (step.py) and of ``seq_penalties``, in order.
PENALTY_NAMES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
assert len(PENALTY_NAMES) == N_PENALTIES

# Shared-memory scratch sizes (compile-time constants).
MAX_CANDIDATES = 1024
assert MAX_CANDIDATES >= MAX_SEQS + 1


class SchedulerArrays(NamedTuple):
    """Every array one iteration touches. Field order is the order of the device address table (image.py)."""

    # The ring (views of the region the agent writes).
    control: object         # CONTROL_RECORD [1]  the control block
    state: object           # u32 [n]     status columns
    epoch: object
    cancel: object
    finish: object
    ngen: object
    headers: object         # HEADER_RECORD [n]  request headers
    stop_token_ids: object  # i32 [n, max_stop_ids] (or [n, 1] when the ring has no such region)
    prompts: object         # i32 [n, max_prompt_tokens]
    prefix_keys: object     # u64 [n, prefix_key_pages] keys of each prompt's full pages (or [n, 1] without keys)
    outputs: object         # i32 [n, max_output_tokens]
    logprobs: object        # f32 [n, max_output_tokens] (or [n, 1] when the ring has no logprobs area)
    # The pair regions as rows of 32-bit words (token at 2 k, value at 2 k + 1), read as int32 and as float32;
    # [n, 2] when the ring has no such region.
    bias_i32: object        # [n, 2 max_logit_bias]  each request's logit_bias pairs
    bias_f32: object
    top_i32: object         # [n, 2 max_output_tokens max_top_logprobs]  top logprobs of each output position
    top_f32: object
    grammars: object        # i32 [max_grammar_bytes / 4]  compiled grammars (ring/grammar.py; [1] without the region)
    # Step inputs and outputs (StepBuffers).
    num_seqs: object
    token_ids: object
    positions: object
    slot_mapping: object
    query_start_loc: object
    seq_lens: object
    attn_query_start_loc: object
    attn_seq_lens: object
    block_tables: object
    logits_indices: object
    temperature: object
    top_p: object
    top_k: object
    seed: object
    prompt_lens: object
    penalties: object
    min_p: object
    n_logit_bias: object
    logit_bias_ids: object
    logit_bias: object
    grammar_state: object
    sampled_ids: object
    sampled_logprobs: object
    sampled_top_ids: object
    sampled_top_logprobs: object
    # The step's token history (models/history.py ``TokenHistory.tokens``; step.py): the token fed at each KV cell.
    history_tokens: object  # i32 [>= num_pages * page_size]  read through seq_pages (speculation.token_at)
    # Scheduler state (device memory only).
    sched: object           # SCHED_DTYPE [1]  the scheduler's scalars
    stats: object           # STATS_DTYPE [1]  device copies of the control block's counters, profile, doorbells seen
    cfg: object             # CFG_DTYPE [1]
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
    seq_penalties: object   # f32 [n, 3]  presence, frequency, repetition (PENALTY_NAMES)
    seq_min_p: object       # f32 [n]
    seq_top_logprobs: object  # i32 [n]  top logprobs per output position the request asked for
    seq_n_logit_bias: object  # i32 [n]
    seq_bias_ids: object    # i32 [n, max_logit_bias or 1]  the request's logit_bias, copied at admission
    seq_bias: object        # f32 [n, max_logit_bias or 1]
    seq_grammar: object     # i32 [n]  the state its grammar is in, a word offset into ``grammar_mirror`` (-1: none)
    seq_num_speculative_tokens: object  # i32 [n]  the request's cap on its drafts per step (its header's)
    seq_draft: object       # i32 [n, MAX_SPECULATIVE_TOKENS]  the drafts planned after its last token (speculation)
    seq_ndraft: object      # i32 [n]  how many of them the planned step verifies (0: a plain decode or a chunk)
    seq_keys: object        # u64 [n, max_pages_per_seq]  prefix key of each full page (prompt: the ring's)
    seq_hash: object        # u64 [n]  prefix-key chain state after the sequence's last known token
    seq_seen: object        # i32 [n]  a READY slot the scheduler holds: QUEUED or REFUSED (0: none; see below)
    queue_slots: object     # i32 [n]  the waiting queue (waiting.py), sorted by (key, slot)
    queue_keys: object      # i64 [n]
    queue_tmp_slots: object  # i32 [n] scratch for merging
    queue_tmp_keys: object  # i64 [n]
    running: object         # i32 [max_num_seqs]  ring slots, in admission order
    consumed: object        # i32 [max_num_seqs]  slot whose token row r of the last step delivered (-1: none)
    pending_finished: object  # i32 [n]  finished slots whose FINISHED state is not yet published (each at most once)
    row_slot: object        # i32 [max_num_seqs]  ring slot of each row of the last planned step
    row_version: object     # i32 [max_num_seqs]  seq_version of that slot when the row was last written
    row_pages: object       # i32 [max_num_seqs]  block-table entries already copied into that row
    row_draft: object       # i32 [max_num_seqs]  j > 0: the row verifies draft j of its slot (its group's first: 0)
    # Pages and the prefix cache (kv.py, prefix.py).
    page_ref: object        # i32 [num_pages]  block tables that hold the page
    page_cached: object     # i32 [num_pages]  1: the page is in the table under page_key
    page_key: object        # u64 [num_pages]
    page_lru: object        # i32 [num_pages]  index of its live entry in lru_pages (-1: not evictable)
    page_scratch: object    # i32 [num_pages]  per-page word of one block-wide pass (SCRATCH_CLEAR between)
    lru_pages: object       # i32 [2 num_pages]  ring of freed cached pages, oldest first (entries may be stale)
    table_keys: object      # u64 [table entries]  the hash table: PREFIX_WAYS ways per bucket
    table_pages: object     # i32 [table entries]  -1: empty way
    # Grammars (grammar.py).
    grammar_mirror: object  # i32 [like grammars]  the placements requests in flight follow, at the ring's offsets


class Scratch(NamedTuple):
    """Shared-memory work arrays of one iteration, by role (each phase's docstring says what it keeps in which).

    ``slots``: the ring slots a phase works on (finishing, a preemption victim, new candidates); ``keys``: their
    int64 sort keys, or per step row the first block-table entry it still lacks; ``rank``: a 0/1 flag per running
    sequence, scanned into its rank among the flagged ones (finishing; having a chunk = its step row); ``pages``:
    page counts per item, scanned into offsets (pages to free, to allocate, to copy into a row's block table);
    ``tokens``: token counts per running sequence, scanned into offsets (tokens wanted before it, its first token
    row); ``chunk``: the tokens each running sequence gets in the planned step; ``kept``: the running list being
    compacted; ``partial``: per-warp partial sums of the block scans; ``counters``: the iteration's counters (COUNT);
    ``cycles``: what each phase of the part took (PHASE), added to the profile where the part ends.
    """

    slots: object       # i32 [MAX_CANDIDATES]
    keys: object        # i64 [MAX_CANDIDATES]
    rank: object        # i32 [MAX_CANDIDATES]
    pages: object
    tokens: object
    chunk: object
    kept: object
    partial: object     # i32 [MAX_THREADS]
    counters: object    # i32 [N_COUNTERS]  indexed by COUNT
    cycles: object      # i64 [N_PHASES]  indexed by PHASE


# seq_seen values. QUEUED: the slot waits in the queue. REFUSED: finished while READY (cancelled or unservable),
# its FINISHED state not yet published; the slot stays READY in the ring until then and no scan may take it again.
QUEUED, REFUSED = 1, 2


class Counts(NamedTuple):
    """The counters of one part of an iteration (``sh.counters[COUNT.tokens]``), zeroed where it starts;
    ``fold_counts`` adds some to the device counters of the same name (``s.stats[0]``) where it ends."""

    tokens: int
    stopped: int
    finished: int
    cancelled: int
    new: int
    admitted: int
    preempted: int
    victim: int
    scan: int
    cancel_bell: int
    ending: int
    prefills: int
    decode_pages: int
    need: int
    moved: int
    bucket: int
    bucket_tokens: int
    copies: int
    chunked: int
    refused: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_evictions: int
    prefill_tokens: int
    completed: int
    lru_end: int
    unevicted: int
    inserted: int
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    grammars: int


COUNT = indices(Counts)
# After the named counters, one per draft position: sh.counters[SPEC_ACCEPTED_PER_POS + j] counts the drafts accepted
# at position j (fold_counts adds them to stats' ``spec_accepted_per_pos``, publish_stats stores those in the ring).
SPEC_ACCEPTED_PER_POS = len(COUNT)
N_COUNTERS = SPEC_ACCEPTED_PER_POS + MAX_SPECULATIVE_TOKENS

# The prefix cache's hash table: buckets of PREFIX_WAYS ways, at least twice as many entries as pages.
PREFIX_WAYS = 16
SCRATCH_CLEAR = (1 << 31) - 1    # page_scratch between passes


def table_entries(num_pages: int) -> int:
    """Entries of the hash table for ``num_pages`` pages: a power of two of buckets, >= 2 x num_pages entries."""
    buckets = 1
    while buckets * PREFIX_WAYS < 2 * num_pages:
        buckets *= 2
    return buckets * PREFIX_WAYS
