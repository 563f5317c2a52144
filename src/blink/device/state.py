"""The scheduler's memory: every array one iteration touches and the word indices into them.

``SchedulerArrays`` groups the ring (views of the region the agent writes), the step buffers (``step.py``) and the
scheduler's own state in device memory. The same tuple is built from numpy arrays for the CPU simulator and from
device addresses on the GPU (``launch.py``), so kv, batcher and scheduler code never knows which it runs on.
"""
from __future__ import annotations

from typing import NamedTuple


from blink.device.config import MAX_SEQS
from blink.device.step import N_PENALTIES
from blink.ring.control import word_index
from blink.ring.layout import header_dtype


def _names(*names: str) -> range:
    """Consecutive word indices 0, 1, ... for ``names`` (the names document what each index holds)."""
    return range(len(names))


# Scheduler scalars (s.sched, int32). The prefix cache's (kv.py, prefix.py): evictable = cached pages no sequence
# holds (free pages = the free stack + these), cached = pages in the table, lru_head / lru_count = the LRU ring.
SCHED_NAMES = ("running", "free_top", "rows", "bucket", "queued", "queue_head", "consumed", "pending_finished",
               "publishable", "evictable", "cached", "lru_head", "lru_count")
N_RUNNING, FREE_TOP, N_ROWS, BUCKET, N_QUEUED, QUEUE_HEAD, N_CONSUMED, N_PENDING_FINISHED, N_PUBLISHABLE, \
    N_EVICTABLE, N_CACHED, LRU_HEAD, LRU_COUNT = _names(*SCHED_NAMES)
SCHED_WORDS = len(SCHED_NAMES)

IDLE = -1       # nothing to run: back off, then iterate again
STOP = -2       # shutdown done: do not relaunch

# Scheduler configuration words (s.cfg).
CFG_NAMES = ("page_size", "token_budget", "max_num_seqs", "n_buckets", "n_eos", "watermark", "max_model_len",
             "logprobs", "max_stop", "prefix_caching", "max_logit_bias", "max_top_logprobs", "grammar_words",
             "mask_words", "spec_tokens", "spec_min", "spec_max")
CFG_PAGE_SIZE, CFG_TOKEN_BUDGET, CFG_MAX_NUM_SEQS, CFG_N_BUCKETS, CFG_N_EOS, CFG_WATERMARK, CFG_MAX_MODEL_LEN, \
    CFG_LOGPROBS, CFG_MAX_STOP, CFG_PREFIX_CACHING, CFG_MAX_LOGIT_BIAS, CFG_MAX_TOP_LOGPROBS, CFG_GRAMMAR_WORDS, \
    CFG_MASK_WORDS, CFG_SPEC_TOKENS, CFG_SPEC_MIN, CFG_SPEC_MAX = _names(*CFG_NAMES)
CFG_WORDS = len(CFG_NAMES)

# Control-block words, as indices into the u32 (C32_*) and u64 (C64_*) views of the block.
C32_SHUTDOWN, C32_ENGINE_STATE, C32_IN_STEP = (word_index(n, 4) for n in ("shutdown", "engine_state", "in_step"))
C32_KV_TOTAL, C32_KV_FREE, C32_RUNNING, C32_WAITING, C32_CACHED_PAGES = (
    word_index(n, 4) for n in ("kv_pages_total", "kv_pages_free", "running", "waiting", "cached_pages"))
C64_HEARTBEAT, C64_STEPS, C64_TOKENS, C64_ADMITTED, C64_FINISHED, C64_CANCELLED, C64_PREEMPTED = (
    word_index(n, 8) for n in ("heartbeat", "steps", "tokens", "admitted", "finished", "cancelled", "preempted"))
C64_PREFIX_QUERIES, C64_PREFIX_HITS, C64_EVICTIONS, C64_PREFILL_TOKENS = (
    word_index(n, 8) for n in ("prefix_query_tokens", "prefix_hit_tokens", "prefix_evictions", "prefill_tokens"))
C64_SPEC_DRAFTS, C64_SPEC_DRAFT_TOKENS, C64_SPEC_ACCEPTED = (
    word_index(n, 8) for n in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))
C64_SUBMITTED, C64_CANCELS = word_index("submitted", 8), word_index("cancels", 8)
C64_PREFIX_SEED = word_index("prefix_seed", 8)      # written by the ring's creator; its device copy is read only
COUNTERS = (C64_HEARTBEAT, C64_STEPS, C64_TOKENS, C64_ADMITTED, C64_FINISHED, C64_CANCELLED, C64_PREEMPTED,
            C64_PREFIX_QUERIES, C64_PREFIX_HITS, C64_EVICTIONS, C64_PREFILL_TOKENS, C64_SPEC_DRAFTS,
            C64_SPEC_DRAFT_TOKENS, C64_SPEC_ACCEPTED)

# s.stats (int64): first the device copies of the control block's u64 words (same indices as C64_*), then the SM
# cycles spent in each phase of the iteration, summed over iterations (thread 0's clock), then the doorbell counts
# the scheduler has acted on.
PROFILE_PHASES = ("doorbells", "consume", "retire", "collect", "admit", "plan", "publish")
P_FIRST = max(*COUNTERS, C64_SUBMITTED, C64_CANCELS, C64_PREFIX_SEED) + 1
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
H64_REQUEST_ID, H64_ARRIVAL, H64_SEED, H64_PREFIX_STATE = (
    _header_word(n, 8) for n in ("request_id", "arrival_ns", "seed", "prefix_state"))
H32_PROMPT_LEN, H32_MAX_TOKENS, H32_TOP_K, H32_FLAGS, H32_N_STOP, H32_PRIORITY, H32_STOP_IDS, H32_TOP_LOGPROBS, \
    H32_N_LOGIT_BIAS, H32_GRAMMAR = (_header_word(n, 4) for n in ("prompt_len", "max_tokens", "top_k", "flags",
                                                                  "n_stop", "priority", "stop_ids", "top_logprobs",
                                                                  "n_logit_bias", "grammar"))
HF_TEMPERATURE, HF_TOP_P, HF_MIN_P = (_header_word(n, 4) for n in ("temperature", "top_p", "min_p"))
# The three penalties are consecutive f32 words of the header, in the order of a row of ``penalties``.
PENALTY_NAMES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
HF_PENALTIES = _header_word(PENALTY_NAMES[0], 4)
assert len(PENALTY_NAMES) == N_PENALTIES
assert [_header_word(n, 4) for n in PENALTY_NAMES] == [HF_PENALTIES + k for k in range(N_PENALTIES)]

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
    seq_penalties: object   # f32 [n, 3]  presence, frequency, repetition (PENALTY_NAMES)
    seq_min_p: object       # f32 [n]
    seq_top_logprobs: object  # i32 [n]  top logprobs per output position the request asked for
    seq_n_logit_bias: object  # i32 [n]
    seq_bias_ids: object    # i32 [n, max_logit_bias or 1]  the request's logit_bias, copied at admission
    seq_bias: object        # f32 [n, max_logit_bias or 1]
    seq_grammar: object     # i32 [n]  the state its grammar is in, a word offset into ``grammars`` (-1: no grammar)
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
    doorbells: object       # i64 [DOORBELL_NAMES]  prefetched by the resident loop (DB_*)
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
                 "scan", "cancel_bell", "ending", "prefills", "decode_pages", "need", "copies", "chunked", "refused",
                 "query_tokens", "hit_tokens", "evicted", "prefill_tokens", "completed", "lru_end", "unevicted",
                 "inserted", "drafts", "draft_tokens", "accepted")
K_TOKENS, K_FINISHED, K_CANCELLED, K_NEW, K_ADMITTED, K_REJECTED, K_PREEMPTED, K_VICTIM, K_SHUTDOWN, K_SCAN, \
    K_CANCEL_BELL, K_ENDING, K_PREFILLS, K_DECODE_PAGES, K_NEED, K_COPIES, K_CHUNKED, K_REFUSED, K_QUERY_TOKENS, \
    K_HIT_TOKENS, K_EVICTED, K_PREFILL_TOKENS, K_COMPLETED, K_LRU_END, K_UNEVICTED, K_INSERTED, K_DRAFTS, \
    K_DRAFT_TOKENS, K_ACCEPTED = _names(*COUNTER_NAMES)
N_COUNTERS = len(COUNTER_NAMES)
# (device counter, iteration counter) pairs that publish_stats folds together.
FOLDED = ((C64_TOKENS, K_TOKENS), (C64_FINISHED, K_FINISHED), (C64_CANCELLED, K_CANCELLED),
          (C64_ADMITTED, K_ADMITTED), (C64_PREEMPTED, K_PREEMPTED), (C64_PREFIX_QUERIES, K_QUERY_TOKENS),
          (C64_PREFIX_HITS, K_HIT_TOKENS), (C64_EVICTIONS, K_EVICTED), (C64_PREFILL_TOKENS, K_PREFILL_TOKENS),
          (C64_SPEC_DRAFTS, K_DRAFTS), (C64_SPEC_DRAFT_TOKENS, K_DRAFT_TOKENS), (C64_SPEC_ACCEPTED, K_ACCEPTED))

# The prefix cache's hash table: buckets of PREFIX_WAYS ways, at least twice as many entries as pages.
PREFIX_WAYS = 16
SCRATCH_CLEAR = (1 << 31) - 1    # page_scratch between passes


def table_entries(num_pages: int) -> int:
    """Entries of the hash table for ``num_pages`` pages: a power of two of buckets, >= 2 x num_pages entries."""
    buckets = 1
    while buckets * PREFIX_WAYS < 2 * num_pages:
        buckets *= 2
    return buckets * PREFIX_WAYS
