"""A request's sampling parameters on their way through the scheduler (device functions, one thread each).

``load_sampling``: at admission, from the ring's header and ``logit_bias`` row into device memory (read across
PCIe once). ``write_sampling``: into the step row that samples for the request, only when the row held another
request (or another admission of it) when it was last written, as the block tables are copied; else only the
grammar's state, the one parameter that changes while a request runs.
``store_top_logprobs``: the step's most likely tokens of a row into the ring's ``top_logprobs`` area, as many as
the request asked for. The request's grammar state (``grammar.py``) travels with them.
"""
from __future__ import annotations

from numba import float32, int32, int64

from blink.device import grammar
from blink.device.numba_compat import cuda, load_volatile
from blink.device.step import N_PENALTIES


@cuda.jit(device=True)
def fits(s, n_bias, top):
    """Whether a header's ``n_logit_bias`` and ``top_logprobs`` counts (``n_bias``, ``top``) fit the ring."""
    return (0 <= n_bias) & (n_bias <= s.cfg[0].max_logit_bias) & (0 <= top) & (top <= s.cfg[0].max_top_logprobs)


@cuda.jit(device=True)
def load_sampling(s, slot):
    """The request's sampling parameters from its header and ``logit_bias`` row into device memory. Every header
    field is read before any is stored: they cross PCIe, and a store waiting for one field's load would hold back
    the next field's, a round trip each."""
    header = s.headers[slot]
    top_k = header.top_k
    temperature = header.temperature
    top_p = header.top_p
    min_p = header.min_p
    seed = int64(header.seed)
    presence_penalty = header.presence_penalty
    frequency_penalty = header.frequency_penalty
    repetition_penalty = header.repetition_penalty
    top_logprobs = header.top_logprobs
    n_bias = int32(header.n_logit_bias)
    flags = header.request_flags
    base = int32(header.grammar)
    s.seq_grammar[slot] = grammar.start_state(s, flags, base)
    s.seq_top_k[slot] = top_k
    s.seq_temperature[slot] = temperature
    s.seq_top_p[slot] = top_p
    s.seq_min_p[slot] = min_p
    s.seq_seed[slot] = seed
    s.seq_penalties[slot, 0] = presence_penalty         # a row of penalties is in PENALTY_NAMES' order
    s.seq_penalties[slot, 1] = frequency_penalty
    s.seq_penalties[slot, 2] = repetition_penalty
    s.seq_top_logprobs[slot] = top_logprobs
    s.seq_n_logit_bias[slot] = n_bias
    for k in range(n_bias):
        s.seq_bias_ids[slot, k] = s.bias_i32[slot, 2 * k]
        s.seq_bias[slot, k] = s.bias_f32[slot, 2 * k + 1]


@cuda.jit(device=True)
def write_sampling(s, r, slot, same):
    """Row ``r`` samples for the request in ``slot``; ``same``: the row was last written for it, so it holds that
    request's parameters already (only this function writes them in the scheduler's steps, and a request's never
    change) but for its grammar's state, which moves on with each token. Every word is read before any is stored
    (``inputs.write_rows`` says why)."""
    if same:
        s.grammar_state[r] = s.seq_grammar[slot]
        return
    temperature = s.seq_temperature[slot]
    top_p = s.seq_top_p[slot]
    top_k = s.seq_top_k[slot]
    min_p = s.seq_min_p[slot]
    seed = s.seq_seed[slot]
    prompt_len = s.seq_prompt_len[slot]
    n_bias = s.seq_n_logit_bias[slot]
    state = s.seq_grammar[slot]
    penalties = cuda.local.array(N_PENALTIES, float32)
    for k in range(N_PENALTIES):
        penalties[k] = s.seq_penalties[slot, k]
    s.temperature[r] = temperature
    s.top_p[r] = top_p
    s.top_k[r] = top_k
    s.min_p[r] = min_p
    s.seed[r] = seed
    s.prompt_lens[r] = prompt_len
    for k in range(N_PENALTIES):
        s.penalties[r, k] = penalties[k]
    s.n_logit_bias[r] = n_bias
    s.grammar_state[r] = state
    for k in range(n_bias):
        s.logit_bias_ids[r, k] = s.seq_bias_ids[slot, k]
        s.logit_bias[r, k] = s.seq_bias[slot, k]


@cuda.jit(device=True)
def store_top_logprobs(s, r, slot, n):
    """Row ``r``'s top tokens as output position ``n`` of ``slot`` (nothing unless the request asked for them).
    Written by the step's kernels on other SMs: volatile loads, as the sampled token's."""
    base = 2 * n * s.cfg[0].max_top_logprobs
    for j in range(s.seq_top_logprobs[slot]):
        at = (int64(r), int64(j))               # a volatile load takes an index tuple of one integer type
        s.top_i32[slot, base + 2 * j] = load_volatile(s.sampled_top_ids, at)
        s.top_f32[slot, base + 2 * j + 1] = load_volatile(s.sampled_top_logprobs, at)
