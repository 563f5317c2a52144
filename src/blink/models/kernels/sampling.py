"""The sampler's kernels in Triton; references: ``sampling_reference.py`` (under the same names in ``reference``),
noise: ``blink.models.hashing``.

Each reads logits in the model's dtype (bf16 on the GPU: half the bytes of float32), converts them to float32 (exact)
and divides by the row's temperature as it reads (``div_rn``: the correctly rounded division torch does), so neither
a float32 copy nor the scaled rows are ever stored.

- ``sampling_params``: each row's greedy flag, divisor and min-p floor in one launch of the step's PDL chain (torch
  took six small kernels outside it).
- ``row_logsumexp``: program ``(row, chunk)`` holds ``CHUNK`` entries of the row in registers and takes their max and
  sum of exponentials, of the row and of the scaled row's min-p survivors (one read instead of torch's two reductions
  of each; the scaled sums are the row's own where the divisor is 1 and there is no floor); one program per row then
  folds the row's chunks (one program per row alone took ~50 us for a 128k vocabulary on the H200: a serial loop of
  loads).
- ``candidate_threshold``: one program per row applies min-p, top-k and top-p to the row's candidates (its largest
  logits, sorted by ``torch.topk``) in registers: one launch instead of ~20 small torch ones.
- ``gumbel_argmax``: program ``(row, chunk)`` derives the row's key from its seed and length (``hashing.row_key``,
  in uint32), holds ``CHUNK`` vocabulary entries and writes its best (value, index); one program per row then picks
  the token among its chunks' (one launch in the chain where torch's argmax and gather took two outside it). The
  first chunk wins a tie, as the lowest index does in the reference.
- ``store_sampled``: one program per row writes a sampled row's token, its logprob and its top logprobs into the
  step's buffers (rows that sample nothing keep theirs): one launch in the step's PDL chain where torch's gathers,
  casts, subtractions and a ``where`` per buffer took nine kernels outside it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hashing import MIX, UNIFORM_BITS
from .pdl import pdl_args, wait_for_previous

CHUNK = 4096
CHUNK_WARPS = 8  # a (row, chunk) program's warps: 16 of its entries a thread, held in registers
_MIX = tl.constexpr(MIX)
_UNIFORM_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
_UNIFORM_SCALE = tl.constexpr(1.0 / (1 << UNIFORM_BITS))


@triton.jit
def _hash32(x):
    x = ((x >> 16) ^ x) * _MIX  # uint32 arithmetic wraps: the same bits as the masked int64 reference
    x = ((x >> 16) ^ x) * _MIX
    return (x >> 16) ^ x


@triton.jit
def _row_key(seed, length):
    """``hashing.row_key`` of one row: int64 ``seed`` split in 32-bit halves, int ``length``."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _hash32(_hash32(_hash32(hi) ^ lo) ^ length.to(tl.uint32))


@triton.jit
def _fold(m, s):
    """Chunks' (max, sum) pairs → log-sum-exp; ``-inf`` where every chunk saw only ``-inf`` (as torch)."""
    top, total = _max_and_sum(m, s)
    return top + tl.log(total)


@triton.jit
def _sampling_params_kernel(temperature_ptr, min_p_ptr, cand_ptr, greedy_ptr, div_ptr, floor_ptr, rows, cand_stride,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < rows
    temperature = tl.load(temperature_ptr + r, mask=ok, other=1.0)  # step buffers: read before the wait
    min_p = tl.load(min_p_ptr + r, mask=ok, other=0.0)
    wait_for_previous(PDL)
    greedy = temperature <= 0
    divisor = tl.where(greedy, 1.0, temperature)
    top = tl.load(cand_ptr + r * cand_stride, mask=ok, other=0.0).to(tl.float32)
    tl.store(greedy_ptr + r, greedy, mask=ok)
    tl.store(div_ptr + r, divisor, mask=ok)
    tl.store(floor_ptr + r, tl.math.div_rn(top, divisor) + tl.log(min_p), mask=ok)


def sampling_params(temperature: torch.Tensor, min_p: torch.Tensor,
                    cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``reference.sampling_params``: float32 ``temperature [S]`` and ``min_p [S]``, ``cand [S, n]`` floating."""
    rows = temperature.shape[0]
    greedy = torch.empty(rows, dtype=torch.bool, device=cand.device)
    divisor = torch.empty(rows, dtype=torch.float32, device=cand.device)
    floor = torch.empty_like(divisor)
    block = min(256, triton.next_power_of_2(max(rows, 1)))
    _sampling_params_kernel[(triton.cdiv(rows, block),)](temperature, min_p, cand, greedy, divisor, floor, rows,
                                                         cand.stride(0), BLOCK=block, **pdl_args(cand.device))
    return greedy, divisor, floor


@triton.jit
def _chunk_logsumexp_kernel(logits_ptr, div_ptr, floor_ptr, part_ptr, vocab, stride, n_chunks, CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
    """Program ``(row, chunk)``: (max, sum of exp(x - max)) of ``CHUNK`` entries of the row and of the scaled row's
    entries ``>= floor``, the chunk held in registers: one exponential an entry a sum (a running max costs two). A row
    with divisor 1 and no floor (greedy, or temperature 1 without min-p) has the same scaled sums: taken, not summed."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    divisor = tl.load(div_ptr + row)
    floor = tl.load(floor_ptr + row)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    top, total = _max_and_sum(x, 1.0)
    part = part_ptr + (row * n_chunks + chunk) * 4
    tl.store(part, top)
    tl.store(part + 1, total)
    if (divisor != 1.0) | (floor != float("-inf")):
        scaled = tl.math.div_rn(x, divisor)
        top, total = _max_and_sum(tl.where(scaled >= floor, scaled, float("-inf")), 1.0)
    tl.store(part + 2, top)
    tl.store(part + 3, total)


@triton.jit
def _max_and_sum(x, weight):
    """(max, sum of ``weight * exp(x - max)``) of a block: its entries' with weight 1, or chunks' (max, sum) pairs
    folded into one; (-inf, 0) for a block of only ``-inf``."""
    top = tl.max(x, 0)
    return top, tl.sum(weight * tl.exp(x - tl.where(top == float("-inf"), 0.0, top)), 0)


@triton.jit
def _fold_chunks_kernel(part_ptr, lse_ptr, lse_scaled_ptr, n_chunks, CHUNKS_P2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    wait_for_previous(PDL)
    c = tl.arange(0, CHUNKS_P2)
    part = part_ptr + (row * n_chunks + c) * 4
    ok = c < n_chunks
    tl.store(lse_ptr + row, _fold(tl.load(part, mask=ok, other=float("-inf")), tl.load(part + 1, mask=ok, other=0.0)))
    tl.store(lse_scaled_ptr + row, _fold(tl.load(part + 2, mask=ok, other=float("-inf")),
                                         tl.load(part + 3, mask=ok, other=0.0)))


def row_logsumexp(logits: torch.Tensor, divisor: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """``logits [S, V]`` floating (unit stride in V), ``divisor [S]`` > 0, ``floor [S]`` float32 → (log-sum-exp of
    each row, of the entries of each row divided by its divisor that are ``>= floor``), float32 ``[S]`` each."""
    rows, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, CHUNK)
    parts = torch.empty((rows, n_chunks, 4), dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse_scaled = torch.empty_like(lse)
    _chunk_logsumexp_kernel[(rows, n_chunks)](logits, divisor, floor, parts, vocab, logits.stride(0), n_chunks,
                                              CHUNK=CHUNK, num_warps=CHUNK_WARPS, **pdl_args(logits.device))
    _fold_chunks_kernel[(rows,)](parts, lse, lse_scaled, n_chunks, CHUNKS_P2=triton.next_power_of_2(n_chunks),
                                 **pdl_args(logits.device))
    return lse, lse_scaled


@triton.jit
def _candidate_threshold_kernel(cand_ptr, div_ptr, lse_scaled_ptr, top_k_ptr, top_p_ptr, floor_ptr, thr_ptr, n, stride,
                                N_P2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    wait_for_previous(PDL)
    rank = tl.arange(0, N_P2)
    cand = tl.load(cand_ptr + row * stride + rank, mask=rank < n, other=float("-inf")).to(tl.float32)
    cand = tl.math.div_rn(cand, tl.load(div_ptr + row))
    top_k = tl.load(top_k_ptr + row)
    k_on = top_k > 0
    floor = tl.load(floor_ptr + row)
    in_k = (rank < tl.where(k_on, tl.minimum(top_k, n), n)) & (cand >= floor)
    masked = tl.where(in_k, cand, float("-inf"))
    top = tl.max(masked, 0)  # the row's largest candidate: finite
    norm = tl.where(k_on, top + tl.log(tl.sum(tl.exp(masked - top), 0)), tl.load(lse_scaled_ptr + row))
    probs = tl.exp(masked - norm)
    mass_before = tl.cumsum(probs, 0) - probs
    top_p = tl.load(top_p_ptr + row)
    keep = tl.where(top_p >= 1, in_k, in_k & ((mass_before < top_p) | (rank == 0)))
    threshold = tl.min(tl.where(keep, cand, float("inf")), 0)
    last_kept = tl.sum(tl.where(keep & (rank == n - 1), 1, 0), 0) > 0
    tl.store(thr_ptr + row, tl.where(last_kept & (top_k <= 0), floor, threshold))


def candidate_threshold(cand: torch.Tensor, divisor: torch.Tensor, lse_scaled: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``cand [S, n]`` floating, each row descending (unit stride in n) → float32 thresholds ``[S]``; as
    ``reference.candidate_threshold``."""
    rows, n = cand.shape
    threshold = torch.empty(rows, dtype=torch.float32, device=cand.device)
    _candidate_threshold_kernel[(rows,)](cand, divisor, lse_scaled, top_k, top_p, floor, threshold, n, cand.stride(0),
                                         N_P2=triton.next_power_of_2(n), num_warps=4, **pdl_args(cand.device))
    return threshold


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, div_ptr, thr_ptr, seed_ptr, len_ptr, greedy_ptr, best_val_ptr, best_idx_ptr,
                          vocab, stride, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(row, chunk)``: the best (value, index) of ``CHUNK`` entries of the row, held in registers (its max
    and argmax in one reduction, the lowest index among equals)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    divisor = tl.load(div_ptr + row)
    thr = tl.load(thr_ptr + row)
    key = _row_key(tl.load(seed_ptr + row).to(tl.int64), tl.load(len_ptr + row))
    greedy = tl.load(greedy_ptr + row) != 0
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = idx < vocab
    x = tl.load(logits_ptr + row * stride + idx, mask=ok, other=float("-inf")).to(tl.float32)
    if divisor != 1.0:  # x / 1 is x: a greedy row divides nothing
        x = tl.math.div_rn(x, divisor)
    if greedy:  # the row's branch: a greedy row computes no noise (its hashes and logarithms are most of the cost)
        val = x
    else:
        bits = _hash32(key ^ _hash32(idx.to(tl.uint32))) >> _UNIFORM_SHIFT  # hashing.uniform
        u = (bits.to(tl.float32) + 0.5) * _UNIFORM_SCALE
        val = tl.where(x >= thr, x - tl.log(-tl.log(u)), float("-inf"))
    val = tl.where(ok, val, float("-inf"))
    best, where = tl.max(val, 0, return_indices=True, return_indices_tie_break_left=True)  # one reduction
    tl.store(best_val_ptr + row * n_chunks + chunk, best)
    tl.store(best_idx_ptr + row * n_chunks + chunk, where + chunk * CHUNK)


@triton.jit
def _pick_chunk_kernel(best_val_ptr, best_idx_ptr, ids_ptr, n_chunks, CHUNKS_P2: tl.constexpr, PDL: tl.constexpr):
    """Program row: the index of the row's best chunk's best value; the first chunk wins a tie (``tl.argmax``)."""
    row = tl.program_id(0)
    wait_for_previous(PDL)
    c = tl.arange(0, CHUNKS_P2)
    best = tl.argmax(tl.load(best_val_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf")), 0)
    tl.store(ids_ptr + row, tl.load(best_idx_ptr + row * n_chunks + best))


def gumbel_argmax(logits: torch.Tensor, divisor: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
                  seq_lens: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """``logits [S, V]`` floating (unit stride in V), ``divisor [S]`` > 0 → int32 token ids ``[S]``."""
    rows, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, CHUNK)
    best_val = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, n_chunks)](logits, divisor, threshold, seed, seq_lens, greedy, best_val, best_idx,
                                            vocab, logits.stride(0), n_chunks, CHUNK=CHUNK, num_warps=CHUNK_WARPS,
                                            **pdl_args(logits.device))
    ids = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _pick_chunk_kernel[(rows,)](best_val, best_idx, ids, n_chunks, CHUNKS_P2=triton.next_power_of_2(n_chunks),
                                **pdl_args(logits.device))
    return ids


@triton.jit
def _store_sampled_kernel(rows_ptr, logits_ptr, ids_ptr, lse_ptr, cand_val_ptr, cand_idx_ptr, out_ids_ptr,
                          out_logprobs_ptr, out_top_ids_ptr, out_top_logprobs_ptr, logits_stride, cand_stride,
                          out_top_stride, top, TOP_P2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    sampled = tl.load(rows_ptr + row) >= 0  # a step buffer: read before the wait
    wait_for_previous(PDL)
    if sampled:
        token = tl.load(ids_ptr + row)
        lse = tl.load(lse_ptr + row)
        tl.store(out_ids_ptr + row, token)
        tl.store(out_logprobs_ptr + row, tl.load(logits_ptr + row * logits_stride + token).to(tl.float32) - lse)
        rank = tl.arange(0, TOP_P2)
        ok = rank < top
        cand = cand_stride * row + rank
        tl.store(out_top_ids_ptr + row * out_top_stride + rank, tl.load(cand_idx_ptr + cand, mask=ok).to(tl.int32),
                 mask=ok)
        tl.store(out_top_logprobs_ptr + row * out_top_stride + rank,
                 tl.load(cand_val_ptr + cand, mask=ok).to(tl.float32) - lse, mask=ok)


def store_sampled(out, logits_indices: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor,
                  cand_values: torch.Tensor, cand_indices: torch.Tensor) -> None:
    """As ``reference.store_sampled``: in place on ``out`` (a ``sampler.Sampled`` of the step's buffers)."""
    rows, top = out.top_ids.shape
    if cand_values.stride() != cand_indices.stride() or cand_values.stride(1) != 1:
        raise ValueError(f"store_sampled reads the candidates' values and indices at one unit-stride layout (got "
                         f"strides {cand_values.stride()} and {cand_indices.stride()})")
    _store_sampled_kernel[(rows,)](logits_indices, logits, ids, lse, cand_values, cand_indices, out.ids, out.logprobs,
                                   out.top_ids, out.top_logprobs, logits.stride(0), cand_values.stride(0),
                                   out.top_ids.stride(0), top, TOP_P2=triton.next_power_of_2(max(top, 1)),
                                   **pdl_args(logits.device))
