"""The step's inputs written from a plan (device functions, whole block): ``batcher.plan`` decides each running
sequence's chunk and drafts; these write ``step.py``'s buffers for it, row by row (``write_rows``), then block-table
deltas, token ids, positions and KV slots (``write_tables_and_tokens``), and padding up to the bucket (``pad``); the
steady state's rows in one pass (``write_decodes``); the bucket (``choose_bucket``)."""
from __future__ import annotations

from numba import int64

from blink.device import grammar, sampling, speculation
from blink.device.block import exclusive_scan, locate
from blink.device.numba_compat import cuda
from blink.device.state import COUNT


@cuda.jit(device=True)
def write_rows(s, sh, n):
    """Per-row step inputs for sequences with a chunk; ``sh.rank`` = first row index, ``sh.tokens`` = first token
    row. A sequence has one row for its chunk, or, verifying ``seq_ndraft`` drafts, one row of one token each for its
    last token and every draft (``speculation.py``), each row sampling the token after its own.

    Each thread reads what a row needs before it stores any of it: the compiler cannot tell the arrays apart, so it
    issues no load before a store that comes first, and a store waits for the value it stores; loads and stores taking
    turns would cost a memory round trip per load."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(tid, n, nt):
        chunk = sh.chunk[i]
        if chunk == 0:
            continue
        slot = s.running[i]
        drafts = s.seq_ndraft[slot]
        computed = s.seq_computed[slot]
        total = s.seq_total[slot]
        version = s.seq_version[slot]
        npages = s.seq_npages[slot]
        first_row = sh.rank[i]
        first_token = sh.tokens[i]
        query = chunk - drafts                    # tokens per row: the chunk, or 1 while verifying drafts
        for j in range(drafts + 1):
            r = first_row + j
            held = s.row_pages[r]
            same = (s.row_slot[r] == slot) & (s.row_version[r] == version)     # &: both loads at once
            copied = held if same else 0
            sampling.write_sampling(s, r, slot, same)
            start = first_token + j
            length = computed + query + j
            s.query_start_loc[r] = start
            s.seq_lens[r] = length
            # Attention's view: the sequence's rows as one chunk in the first, the others empty (step.py).
            s.attn_query_start_loc[r] = start if j == 0 else first_token + chunk
            s.attn_seq_lens[r] = length + drafts if j == 0 else 0
            s.logits_indices[r] = start + query - 1 if length == total + j else -1
            if j > 0:
                s.grammar_state[r] = grammar.after_drafts(s, slot, j)
            s.row_slot[r] = slot
            s.row_version[r] = version
            s.row_pages[r] = npages
            s.row_draft[r] = j
            sh.keys[r] = copied                       # first block-table entry this row still lacks
            sh.pages[r] = npages - copied             # entries to copy
            if npages != copied:
                cuda.atomic.add(sh.counters, COUNT.copies, 1)
    cuda.syncthreads()


@cuda.jit(device=True)
def write_tables_and_tokens(s, sh, n_rows, n_tokens, all_decode):
    """Block-table deltas of each row, then token ids, positions and KV slots of every token row.

    In an all-decode step token row t is row t; otherwise its row is found by binary search over the row starts.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    total = exclusive_scan(sh.pages, n_rows, sh.partial) if sh.counters[COUNT.copies] != 0 else 0
    for index in range(tid, total, nt):
        r = locate(sh.pages, n_rows, index)
        j = sh.keys[r] + index - sh.pages[r]
        s.block_tables[r, j] = s.seq_pages[s.row_slot[r], j]
    for t in range(tid, n_tokens, nt):
        r = t if all_decode else locate(s.query_start_loc, n_rows, t)
        slot = s.row_slot[r]
        q = s.query_start_loc[r + 1] - s.query_start_loc[r]
        position = s.seq_lens[r] - q + t - s.query_start_loc[r]
        token = speculation.token_at(s, slot, position)
        held = s.seq_pages[slot, position // page]          # read before the stores (write_rows says why)
        s.token_ids[t] = token
        s.positions[t] = position
        s.slot_mapping[t] = int64(held) * page + position % page
    cuda.syncthreads()


@cuda.jit(device=True)
def pad(s, n_rows, n_tokens, bucket_tokens):
    """Rows and token rows between what was planned and the bucket's size read as empty / padding."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for t in range(n_tokens + tid, bucket_tokens, nt):
        s.token_ids[t] = 0
        s.positions[t] = 0
        s.slot_mapping[t] = -1
    for r in range(n_rows + tid, min(bucket_tokens, s.logits_indices.shape[0]), nt):
        s.query_start_loc[r + 1] = n_tokens
        s.attn_query_start_loc[r + 1] = n_tokens
        s.seq_lens[r] = 0
        s.attn_seq_lens[r] = 0
        s.logits_indices[r] = -1
    cuda.syncthreads()


@cuda.jit(device=True)
def choose_bucket(s, sh, tokens):
    """One thread per captured bucket: the one that is the smallest to hold ``tokens`` (the largest, if none does)
    leaves its index in ``COUNT.bucket`` and its size in ``COUNT.bucket_tokens``, for after a barrier. The buckets
    ascend, so each thread compares its own and the one below: one round trip, where walking them takes one per
    bucket (eleven to 64 tokens). The comparisons are joined with ``&`` and ``|``: with ``and`` the compiler read the
    size below only once the thread's own had decided, a round trip later. The block's last threads take the buckets:
    at a batch smaller than the block they are not the rows' threads, so the rows' loads that follow (the steady
    state's test) go out beside these from other warps instead of a round trip behind them."""
    n_buckets = s.cfg[0].n_buckets
    for k in range(cuda.blockDim.x - 1 - cuda.threadIdx.x, n_buckets, cuda.blockDim.x):
        size = s.buckets[k]
        below = s.buckets[max(k - 1, 0)]
        if ((size >= tokens) | (k == n_buckets - 1)) & ((k == 0) | (below < tokens)):
            sh.counters[COUNT.bucket] = k
            sh.counters[COUNT.bucket_tokens] = size


@cuda.jit(device=True)
def write_decodes(s, sh, n):
    """The steady state's inputs (``batcher.decodes_in_place``), what ``write_rows``, ``write_tables_and_tokens``
    and ``pad`` write for it, in one pass: row i is the one token of ``running[i]`` (``sh.slots[i]``), its new
    block-table entries (the pages it took since its last step) copied by its own thread; padded to the bucket
    ``choose_bucket`` left."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[0].page_size
    for i in range(tid, n, nt):
        slot = sh.slots[i]
        computed = s.seq_computed[slot]
        npages = s.seq_npages[slot]
        copied = s.row_pages[i]
        token = speculation.token_at(s, slot, computed)
        held = s.seq_pages[slot, computed // page]
        sampling.write_sampling(s, i, slot, True)
        for j in range(copied, npages):
            s.block_tables[i, j] = s.seq_pages[slot, j]
        s.query_start_loc[i] = i
        s.attn_query_start_loc[i] = i
        s.seq_lens[i] = computed + 1
        s.attn_seq_lens[i] = computed + 1
        s.logits_indices[i] = i
        s.row_pages[i] = npages
        s.row_draft[i] = 0
        s.token_ids[i] = token
        s.positions[i] = computed
        s.slot_mapping[i] = int64(held) * page + computed % page
    if tid == 0:
        s.query_start_loc[n] = n
        s.attn_query_start_loc[n] = n
        s.num_seqs[0] = n
    pad(s, n, n, sh.counters[COUNT.bucket_tokens])
