"""Speculative decoding on the scheduler's side (device functions): n-gram drafts, proposed and confirmed.

In a step where every running sequence decodes, ``propose`` gives each sequence that can have them up to
``CFG_SPEC_TOKENS`` drafts: the tokens that followed the latest earlier occurrence of its last ``n`` tokens in its own
prompt and output, ``n`` from ``CFG_SPEC_MAX`` down to ``CFG_SPEC_MIN`` (prompt lookup). A sequence with ``k`` drafts
gets ``k + 1`` rows of one token each, its last token and then its drafts (``token_at`` reads a draft as the token
after the last one), each row sampling the token after its own: row ``j``'s context is the sequence plus drafts
``1..j``, its ``seq_lens`` (so its random stream) is what plain decoding would have there, and the penalties read
the drafts from the step's own token history. ``confirm`` then keeps the drafts that the sequence's own sampled
tokens equal, one after another, and the first token that differs (or the token after the last draft): every token
kept is the one plain decoding would have sampled, greedy or seeded, so speculation changes how many tokens a step
makes and never which.

Drafts are planned only where they fit: one row per draft within the step's ``max_num_seqs`` rows, their pages
within the free ones, ``max_tokens`` and ``max_model_len``. A sequence with a grammar keeps the drafts its grammar
lets through, and row ``j`` masks with the state after drafts ``1..j`` (``grammar.after_drafts``). The KV of a
rejected draft's position is left behind and rewritten by the next step before it is read.
"""
from __future__ import annotations

from blink.device import grammar
from blink.device.block import exclusive_scan
from blink.device.kv import free_total
from blink.device.numba_compat import cuda
from blink.device.state import (CFG_MAX_MODEL_LEN, CFG_MAX_NUM_SEQS, CFG_PAGE_SIZE, CFG_SPEC_MAX, CFG_SPEC_MIN,
                                CFG_SPEC_TOKENS, K_DECODE_PAGES, K_DRAFT_TOKENS, K_DRAFTS)


@cuda.jit(device=True)
def token_at(s, slot, position):
    """Token ``position`` of the request in ``slot``: prompt, an earlier output, the last sampled token, or (past it)
    one of the drafts planned after it."""
    prompt_len = s.seq_prompt_len[slot]
    total = s.seq_total[slot]
    if position < prompt_len:
        return s.prompts[slot, position]
    if position == total - 1:
        return s.seq_last[slot]
    if position >= total:
        return s.seq_draft[slot, position - total]
    return s.outputs[slot, position - prompt_len]


@cuda.jit(device=True)
def lookup(s, slot, most):
    """Write into ``seq_draft[slot]`` the at most ``most`` tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for the largest ``n`` that has one; return how many (0: none)."""
    total = s.seq_total[slot]
    for n in range(s.cfg[CFG_SPEC_MAX], s.cfg[CFG_SPEC_MIN] - 1, -1):
        for start in range(total - n - 1, -1, -1):      # latest first; a match ends before the suffix's end
            k = 0
            while k < n and token_at(s, slot, start + k) == token_at(s, slot, total - n + k):
                k += 1
            if k == n:
                count = min(most, total - (start + n))
                for j in range(count):
                    s.seq_draft[slot, j] = token_at(s, slot, start + n + j)
                return count
    return 0


@cuda.jit(device=True)
def wanted(s, slot):
    """How many drafts the sequence in ``slot``, about to decode, may verify in the next step (before the step's
    limits are counted)."""
    if s.cfg[CFG_SPEC_TOKENS] == 0:
        return 0
    generated = s.seq_total[slot] - s.seq_prompt_len[slot]
    most = min(s.cfg[CFG_SPEC_TOKENS], s.seq_max_tokens[slot] - generated - 1,
               s.cfg[CFG_MAX_MODEL_LEN] - s.seq_total[slot])
    return grammar.allowed_drafts(s, slot, lookup(s, slot, most)) if most > 0 else 0


@cuda.jit(device=True)
def propose(s, sh, n):
    """All-decode steps: each running sequence ``i`` gets ``sh.chunk[i] = 1 + drafts`` tokens (``seq_ndraft``), the
    drafts cut in running order to the rows and pages left. Scratch: ``sh.tokens``, ``sh.pages``, ``sh.rank``."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    page = s.cfg[CFG_PAGE_SIZE]
    for i in range(tid, n, nt):
        slot = s.running[i]
        k = wanted(s, slot)
        decoded = s.seq_computed[slot] + 1
        sh.rank[i] = k
        sh.tokens[i] = k
        sh.pages[i] = (decoded + k + page - 1) // page - (decoded + page - 1) // page
    cuda.syncthreads()
    exclusive_scan(sh.tokens, n, sh.partial)
    exclusive_scan(sh.pages, n, sh.partial)
    rows_left = s.cfg[CFG_MAX_NUM_SEQS] - n
    pages_left = free_total(s) - sh.counters[K_DECODE_PAGES]
    for i in range(tid, n, nt):
        slot = s.running[i]
        k = sh.rank[i]
        decoded = s.seq_computed[slot] + 1
        extra = (decoded + k + page - 1) // page - (decoded + page - 1) // page
        if sh.tokens[i] + k > rows_left or sh.pages[i] + extra > pages_left:
            k = 0
        s.seq_ndraft[slot] = k
        sh.chunk[i] = 1 + k
        if k > 0:
            cuda.atomic.add(sh.counters, K_DRAFTS, 1)
            cuda.atomic.add(sh.counters, K_DRAFT_TOKENS, k)
    cuda.syncthreads()
