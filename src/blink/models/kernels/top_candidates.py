"""The sampler's candidates in Triton: each row's ``n`` largest logits and their ids, descending, searched only in the
rows that read them; reference: ``reference.top_candidates`` (``torch.topk``, in ``sampling_reference.py``).

``torch.topk`` searches every row of the bucket, though a greedy row, a row with no top-k / top-p / min-p filter and
no top logprobs, and a row that samples nothing never read its candidates (170 us of a 64-row step's sampling on the
H200). Here a row ``needs`` candidates when it samples (``logits_indices >= 0``) and filters or the step writes top
logprobs; the others get ``-inf`` values and id 0 at once.

A radix select over the logits' 16-bit order-preserving keys (bf16 / fp16), one 8-bit digit a round:
- ``_histogram_kernel``, program ``(row, chunk)``: the digit's 256-bin histogram of the chunk's ``CHUNK`` entries
  whose higher digit is the row's prefix, stored whole (no atomics, no zeroed buffer);
- ``_pick_kernel``, program ``row``: sums its chunks' histograms and takes the bin where the count from the top reaches
  the entries still to choose; after two rounds the prefix is the key of the row's n-th largest entry;
- ``_gather_kernel``, program ``(row, chunk)``: the chunk's entries above that key (a counter per row, zeroed by the
  first pick, gives each chunk its place) and, of the entries equal to it, the lowest ids still missing (the earlier
  chunks' counts from the last round's histograms place them) into the row's ``n`` slots, each as
  ``key << 32 | ~id`` so that one sort orders them by value, then by id: the result is the same however the chunks
  run;
- ``_sort_kernel``, program ``row``: sorts the row's slots, descending, and writes values (read back from the logits
  at the ids) and ids.
Every shape is fixed, so it captures in a CUDA graph; every kernel waits in the step's PDL chain. Float32 logits (a
float32 model) take the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous
from .sampling_reference import top_candidates as torch_top_candidates

CHUNK = 4096
BINS = tl.constexpr(256)  # one 8-bit digit


@triton.jit
def _needs(idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, TOP: tl.constexpr):
    """Whether ``row`` reads its candidates: it samples and filters, or the step writes top logprobs. Step buffers:
    read before the wait."""
    samples = tl.load(idx_ptr + row) >= 0
    if TOP:
        return samples
    filters = (tl.load(top_k_ptr + row) > 0) | (tl.load(top_p_ptr + row) < 1) | (tl.load(min_p_ptr + row) > 0)
    return samples & filters


@triton.jit
def _keys(logits_ptr, row, chunk, stride, vocab, CHUNK: tl.constexpr):
    """The chunk's ids, their logits' order-preserving 16-bit keys (int32) and the mask of ids inside the row."""
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = ids < vocab
    raw = tl.load(logits_ptr + row * stride + ids, mask=inside, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
    raw = raw & 0xFFFF
    return ids, tl.where(raw >= 0x8000, 0xFFFF - raw, raw | 0x8000), inside


@triton.jit
def _histogram_kernel(logits_ptr, idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, prefix_ptr, hist_ptr, stride, vocab,
                      n_chunks, SHIFT: tl.constexpr, TOP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    needs = _needs(idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, TOP)
    wait_for_previous(PDL)
    if needs:
        _, key, inside = _keys(logits_ptr, row, chunk, stride, vocab, CHUNK)
        match = inside
        if SHIFT == 0:
            match = match & ((key >> 8) == tl.load(prefix_ptr + row))
        # The entries that do not match count in bin 0 and are taken out of it after: Triton's histogram costs
        # ballots per bin, so a spare 257th bin for them would double its time. The counts are exact: the gather
        # reads the last round's count at the n-th largest key.
        bins = tl.arange(0, BINS)
        counts = tl.histogram(tl.where(match, (key >> SHIFT) & 0xFF, 0), BINS)
        counts -= tl.where(bins == 0, CHUNK - tl.sum(match.to(tl.int32), 0), 0)
        tl.store(hist_ptr + (row * n_chunks + chunk) * BINS + bins, counts)


@triton.jit
def _pick_kernel(idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, hist_ptr, prefix_ptr, left_ptr, taken_ptr, n, n_chunks,
                 FIRST: tl.constexpr, TOP: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    needs = _needs(idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, TOP)
    wait_for_previous(PDL)
    if needs:
        bins = tl.arange(0, BINS)
        counts = tl.zeros([BINS], tl.int32)
        for chunk in range(n_chunks):
            counts += tl.load(hist_ptr + (row * n_chunks + chunk) * BINS + bins)
        left = n if FIRST else tl.load(left_ptr + row)
        from_top = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts  # entries in this bin or above
        digit = tl.max(tl.where(from_top >= left, bins, -1), 0)
        above = tl.sum(tl.where(bins > digit, counts, 0), 0)
        prefix = digit if FIRST else tl.load(prefix_ptr + row) * BINS + digit
        tl.store(prefix_ptr + row, prefix)
        tl.store(left_ptr + row, left - above)
        if FIRST:  # the gather's slot counter, zero before it
            tl.store(taken_ptr + row, 0)


@triton.jit
def _gather_kernel(logits_ptr, idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, prefix_ptr, left_ptr, taken_ptr, hist_ptr,
                   slots_ptr, stride, vocab, n, n_chunks, CHUNKS_P2: tl.constexpr, TOP: tl.constexpr,
                   CHUNK: tl.constexpr, PDL: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    needs = _needs(idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, TOP)
    wait_for_previous(PDL)
    if needs:
        ids, key, inside = _keys(logits_ptr, row, chunk, stride, vocab, CHUNK)
        threshold, left = tl.load(prefix_ptr + row), tl.load(left_ptr + row)
        above = (inside & (key > threshold)).to(tl.int32)
        equal = (inside & (key == threshold)).to(tl.int32)
        # The entries above all go in, in any order (the sort orders them); of the equal ones the lowest ids, so the
        # result does not hang on the order the chunks run in: each chunk's equal entries follow the earlier chunks',
        # counted by the last round's histograms at the threshold's low digit.
        earlier = tl.arange(0, CHUNKS_P2)
        base_equal = tl.sum(tl.load(hist_ptr + (row * n_chunks + earlier) * BINS + (threshold & 0xFF),
                                    mask=earlier < chunk, other=0), 0)
        counted = above | (equal << 16)  # one scan counts both: a chunk's counts are below 2^16
        before = tl.cumsum(counted, 0)
        base_above = tl.atomic_add(taken_ptr + row, tl.sum(above, 0), sem="relaxed")
        slot_above = base_above + (before & 0xFFFF) - above
        slot_equal = base_equal + (before >> 16) - equal
        packed = (key.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))  # by value, then the lower id first
        slots = slots_ptr + row * n
        tl.store(slots + slot_above, packed, mask=above > 0)
        tl.store(slots + (n - left) + slot_equal, packed, mask=(equal > 0) & (slot_equal < left))


@triton.jit
def _sort_kernel(logits_ptr, idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, slots_ptr, values_ptr, ids_ptr, stride, n,
                 N_P2: tl.constexpr, TOP: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    needs = _needs(idx_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, TOP)
    wait_for_previous(PDL)
    rank = tl.arange(0, N_P2)
    inside = rank < n
    if needs:
        packed = tl.sort(tl.load(slots_ptr + row * n + rank, mask=inside, other=-1), descending=True)
        ids = 0xFFFFFFFF - (packed & 0xFFFFFFFF)
        values = tl.load(logits_ptr + row * stride + ids, mask=inside, other=0.0)
    else:
        ids = tl.zeros([N_P2], tl.int64)
        values = tl.full([N_P2], float("-inf"), tl.float32).to(values_ptr.dtype.element_ty)
    tl.store(ids_ptr + row * n + rank, ids, mask=inside)
    tl.store(values_ptr + row * n + rank, values, mask=inside)


def top_candidates(logits: torch.Tensor, n: int, logits_indices: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, top: int):
    """As ``reference.top_candidates``: ``logits [S, V]`` with unit stride in V → ``(values [S, n]`` in the logits'
    dtype, ``indices [S, n]`` int64``)``."""
    if logits.element_size() != 2:
        return torch_top_candidates(logits, n, logits_indices, top_k, top_p, min_p, top)
    if logits.stride(1) != 1 or not 1 <= n <= logits.shape[1]:
        raise ValueError(f"top_candidates reads [S, V] logits at unit stride in V and takes 1 <= n <= V (got strides "
                         f"{logits.stride()}, n={n})")
    rows, vocab = logits.shape
    device, n_chunks = logits.device, triton.cdiv(vocab, CHUNK)
    step = (logits_indices, top_k, top_p, min_p)
    hist = torch.empty((rows, n_chunks, BINS), dtype=torch.int32, device=device)
    prefix, left = (torch.empty(rows, dtype=torch.int32, device=device) for _ in range(2))
    taken = torch.empty(rows, dtype=torch.int32, device=device)
    slots = torch.empty((rows, n), dtype=torch.int64, device=device)
    values = torch.empty((rows, n), dtype=logits.dtype, device=device)
    indices = torch.empty((rows, n), dtype=torch.int64, device=device)
    pdl, grid = pdl_args(device), (rows, n_chunks)
    for shift in (8, 0):
        _histogram_kernel[grid](logits, *step, prefix, hist, logits.stride(0), vocab, n_chunks, SHIFT=shift,
                                TOP=top > 0, CHUNK=CHUNK, **pdl)
        _pick_kernel[(rows,)](*step, hist, prefix, left, taken, n, n_chunks, FIRST=shift == 8, TOP=top > 0, **pdl)
    _gather_kernel[grid](logits, *step, prefix, left, taken, hist, slots, logits.stride(0), vocab, n, n_chunks,
                         CHUNKS_P2=triton.next_power_of_2(n_chunks), TOP=top > 0, CHUNK=CHUNK, **pdl)
    _sort_kernel[(rows,)](logits, *step, slots, values, indices, logits.stride(0), n,
                          N_P2=triton.next_power_of_2(n), TOP=top > 0, **pdl)
    return values, indices
