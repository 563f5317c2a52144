"""Speculative decoding on the scheduler's side (device functions): n-gram drafts, proposed and confirmed.

Once a step's decodes are planned (before its prefill chunks), ``propose`` gives each decoding sequence that can have
them up to ``cfg.spec_tokens`` drafts: the tokens that followed the latest earlier occurrence of its last ``n``
tokens in its own prompt and output, ``n`` from ``cfg.spec_max`` down to ``cfg.spec_min`` (prompt lookup), read from
the token history the steps recorded, in device memory (``token_at``), not from the ring. A sequence with ``k``
drafts gets ``k + 1`` rows of one token each, its last token and then its drafts (``token_at`` reads a draft as the
token after the last one), each row sampling the token after its own: row ``j``'s context is the sequence plus
drafts ``1..j``, its ``seq_lens`` (so its random stream) is what plain decoding would have there, and the penalties
read the drafts from the step's own token history. ``confirm`` then keeps the drafts that the sequence's own sampled
tokens equal, one after another, and the first token that differs (or the token after the last draft): every token
kept is the one plain decoding would have sampled, greedy or seeded, so speculation changes how many tokens a step
makes and never which.

Drafts are planned only where they fit: one row per draft within the step's ``max_num_seqs`` rows, their pages
within the free ones, ``max_tokens`` and ``max_model_len``. A sequence with a grammar keeps the drafts its grammar
lets through, and row ``j`` masks with the state after drafts ``1..j`` (``grammar.after_drafts``). The KV of a
rejected draft's position is left behind and rewritten by the next step before it is read; a page the drafts took
stays the sequence's (``kv.pages_short`` counts it held, not free) until its later tokens fill it.
"""
from __future__ import annotations

from numba import int32, int64

from blink.device import grammar
from blink.device.block import exclusive_scan, locate
from blink.device.kv import free_total, pages_short
from blink.device.numba_compat import cuda, load_volatile
from blink.device.state import COUNT


@cuda.jit(device=True)
def token_at(s, slot, position):
    """Token ``position`` of the request in ``slot``: one the steps were fed (from the token history), its prompt, an
    earlier output, the last sampled token, or (past it) one of the drafts planned after it.

    Invariant: every position below ``seq_computed`` holds the sequence's token in ``history_tokens``, at its KV cell
    through the sequence's own block table (``seq_pages``), so such a position is read from device memory, never
    from the ring (across PCIe on the GPU). A position is counted computed only by ``consume``, after the step that
    fed it ran and recorded it (``step.py``), or at admission for a prefix-cache hit, whose pages hold the tokens the
    sequence that computed them recorded (a cached page is full and nobody writes it; evicting it takes it out of
    the table first). Accepted drafts were fed as draft rows and equal the tokens kept; a rejected draft's position
    lies at or beyond the new ``seq_total - 1``, is not computed, and is fed again before it counts. Preemption drops
    the block table and ``seq_computed`` together: the sequence re-prefills from the ring. Positions from
    ``seq_computed`` on (the ones a plan feeds) come from the ring, ``seq_last`` and ``seq_draft``. ``lookup`` reads
    only decoding sequences (``seq_computed == seq_total - 1``): all it reads but the last token is history.
    """
    if position < s.seq_computed[slot]:
        page = s.cfg[0].page_size
        # Written by the step's kernels on other SMs: a resident scheduler must not read a stale L1 line (a cell
        # it read before the step wrote it, or a page's earlier owner's).
        return load_volatile(s.history_tokens, int64(s.seq_pages[slot, position // page]) * page + position % page)
    prompt_len = s.seq_prompt_len[slot]
    total = s.seq_total[slot]
    last = s.seq_last[slot]             # with the two above: a decode's token (the common case) in one round trip
    if position < prompt_len:
        return s.prompts[slot, position]
    if position == total - 1:
        return last
    if position >= total:
        return s.seq_draft[slot, position - total]
    return s.outputs[slot, position - prompt_len]


@cuda.jit(device=True)
def lookup(s, slots, n, most, offsets, best, partial):
    """All threads: for each sequence ``i`` of ring slots ``slots[0:n]``, write into its ``seq_draft`` the at most
    ``most[i]`` tokens that followed the latest earlier occurrence of its last tokens, as many of them as have one
    from ``cfg.spec_max`` down to ``cfg.spec_min``, and replace ``most[i]`` by how many (0: none).

    The sequences are searched together: each pair of a sequence and a candidate end position ``e`` (an occurrence
    ends before the sequence's last token) is one item, the items flattened over the block's threads (``offsets``:
    each sequence's candidates, scanned), so the barriers do not grow with ``n`` and short contexts share a pass. An
    item counts how many tokens ending at ``e`` equal the sequence's last ones, up to ``cfg.spec_max``; each sequence
    keeps the largest count, then the latest ``e``, as one int64 key in ``best[i]`` (count above, position below).
    Scratch: ``offsets`` and ``best`` (``n`` each), ``partial`` (the scan's).
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    longest, shortest = s.cfg[0].spec_max, s.cfg[0].spec_min
    for i in range(tid, n, nt):
        best[i] = -1
        offsets[i] = s.seq_total[slots[i]] - 1 if most[i] > 0 else 0
    cuda.syncthreads()
    items = exclusive_scan(offsets, n, partial)
    for index in range(tid, items, nt):
        i = locate(offsets, n, index)
        slot = slots[i]
        end = index - offsets[i]
        last = s.seq_total[slot] - 1
        k = 0
        while k < longest and k <= end and token_at(s, slot, end - k) == token_at(s, slot, last - k):
            k += 1
        if k >= shortest:
            cuda.atomic.max(best, i, (int64(k) << 32) | end)
    cuda.syncthreads()
    for i in range(tid, n, nt):
        slot = slots[i]
        count = 0
        if best[i] >= 0:
            end = int32(best[i] & 0xFFFFFFFF)
            count = min(most[i], s.seq_total[slot] - 1 - end)
            for j in range(count):
                s.seq_draft[slot, j] = token_at(s, slot, end + 1 + j)
        most[i] = count
    cuda.syncthreads()


@cuda.jit(device=True)
def budget(s, slot):
    """How many drafts the sequence in ``slot``, about to decode, may verify in the next step: the configured
    number and the request's own cap, within its ``max_tokens`` and ``max_model_len`` (the step's rows and pages are
    counted after)."""
    generated = s.seq_total[slot] - s.seq_prompt_len[slot]
    return max(0, min(s.cfg[0].spec_tokens, s.seq_num_speculative_tokens[slot], s.seq_max_tokens[slot] - generated - 1,
                      s.cfg[0].max_model_len - s.seq_total[slot]))


@cuda.jit(device=True)
def draft_pages(s, slot, k):
    """Pages ``k`` drafts take beyond the ones the sequence in ``slot`` needs to decode its next token (none where it
    still holds the pages earlier drafts took)."""
    decoded = s.seq_computed[slot] + 1
    return pages_short(s, slot, decoded + k) - pages_short(s, slot, decoded)


@cuda.jit(device=True)
def propose(s, sh, n):
    """Each decoding sequence ``i`` (``sh.chunk[i] == 1``, its decode planned) gets ``sh.chunk[i] = 1 + drafts``
    tokens (``seq_ndraft``; 0 for the others), the drafts cut in running order to the rows and pages left (their pages
    added to ``COUNT.decode_pages``, before any prefill chunk is planned); none while more than
    ``cfg.disable_by_batch_size`` sequences run (0: no such limit). Scratch: ``sh.rank`` (drafts per sequence),
    ``sh.tokens``, ``sh.pages``, ``sh.keys`` (the lookup's best keys)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    most_seqs = s.cfg[0].disable_by_batch_size
    drafting = most_seqs == 0 or n <= most_seqs
    for i in range(tid, n, nt):
        sh.rank[i] = budget(s, s.running[i]) if drafting and sh.chunk[i] == 1 else 0
    cuda.syncthreads()
    lookup(s, s.running, n, sh.rank, sh.tokens, sh.keys, sh.partial)
    for i in range(tid, n, nt):
        slot = s.running[i]
        sh.rank[i] = grammar.allowed_drafts(s, slot, sh.rank[i])
        sh.tokens[i] = sh.rank[i]
        sh.pages[i] = draft_pages(s, slot, sh.rank[i])
    cuda.syncthreads()
    exclusive_scan(sh.tokens, n, sh.partial)
    exclusive_scan(sh.pages, n, sh.partial)
    rows_left = s.cfg[0].max_num_seqs - n      # every running sequence may take a row
    pages_left = free_total(s) - sh.counters[COUNT.decode_pages]
    cuda.syncthreads()                          # every thread has read the decodes' pages: drafts' come next
    for i in range(tid, n, nt):
        # The rows and pages the sequences before this one asked for are taken, whether or not they got them all;
        # this one keeps the first of its drafts that fit in what is left.
        slot = s.running[i]
        k = min(sh.rank[i], max(0, rows_left - sh.tokens[i]))
        while k > 0 and sh.pages[i] + draft_pages(s, slot, k) > pages_left:
            k -= 1
        s.seq_ndraft[slot] = k
        if k > 0:
            sh.chunk[i] = 1 + k
            cuda.atomic.add(sh.counters, COUNT.decode_pages, draft_pages(s, slot, k))
            cuda.atomic.add(sh.counters, COUNT.spec_drafts, 1)
            cuda.atomic.add(sh.counters, COUNT.spec_draft_tokens, k)
    cuda.syncthreads()
