"""Can the sampler's candidate search beat ``torch.topk`` with (row, chunk) programs? An experiment, not a kernel of
the step. The sampler takes each row's 1,024 largest logits for its top-k / top-p filters with ``torch.topk``, over
every row of the bucket, though greedy rows, rows with no filter and the empty rows of a step never read them: 170 us
of the 203 us of sampling at 64 rows on the H200 (Qwen3's 151,936 logits). A radix select with one program per row,
skipping the rows that do not filter, was latency-bound: 327-522 us at 64 rows (docs/benchmarks/experiments.md,
"A radix top-k for the sampler's candidates").

``top_candidates`` here spreads every row over ``CHUNK``-entry programs. The logits' bits become order-preserving
unsigned keys (16 for bf16 / fp16, 32 for float32); each 8-bit digit, highest first, is found by a histogram pass
(program ``(row, chunk)``, atomics into the row's 256 bins, over the entries whose higher digits match the prefix
chosen so far) and a pick (one program per row: the bin where the count from the top reaches the entries still to
choose). After ``bits / 8`` rounds the prefix is the exact key of the n-th largest entry; a gather pass
``(row, chunk)`` writes every larger entry and as many equal ones as are missing into the row's n slots (atomic
counters give each chunk its place), and one program per row sorts them, descending. Rows that are not ``active``
return at once and get ``-inf``. Every shape is fixed, so it captures in a CUDA graph.

The check: the values of ``torch.topk`` in every active row (ties included), ``-inf`` in the others. The timing:
CUDA-event medians of graph replays against ``torch.topk`` at 1, 16, 64 and 256 rows, with every row, one row and no
row active.

Run: ``PYTHONPATH=src python3 -m bench.experiments.topk_select_bench [--out topk_select_bench.json]`` (``$OUT/...``
when ``$OUT`` is set). On a CPU, ``TRITON_INTERPRET=1 ... --check-only`` runs the check alone on small rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

VOCAB = 151_936         # Qwen3's
CANDIDATES = 1024       # blink.models.sampler.CANDIDATES
ROWS = (1, 16, 64, 256)
CHUNK = 4096
BINS = 256              # one 8-bit digit


@triton.jit
def _chunk(logits_ptr, row, chunk, stride, vocab, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk's logits as float32, their order-preserving unsigned keys (in int64) and the mask of entries inside
    the row; outside it the key is 0 (never counted: every use masks)."""
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    logits = tl.load(logits_ptr + row * stride + cols, mask=mask, other=0.0)
    if KEY_BITS == 16:
        raw = logits.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
        key = tl.where(raw >= 0x8000, 0xFFFF - raw, raw | 0x8000)
    else:
        raw = logits.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(raw >= 0x80000000, 0xFFFFFFFF - raw, raw | 0x80000000)
    return logits.to(tl.float32), key, mask


@triton.jit
def _histogram(logits_ptr, stride, vocab, active_ptr, prefix_ptr, hist_ptr, SHIFT: tl.constexpr,
               KEY_BITS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (row, chunk): the digit at ``SHIFT`` of the chunk's entries whose higher digits are the row's prefix,
    counted into the row's bins."""
    row = tl.program_id(0)
    if tl.load(active_ptr + row) == 0:
        return
    _, key, mask = _chunk(logits_ptr, row, tl.program_id(1), stride, vocab, KEY_BITS, CHUNK)
    match = mask & ((key >> (SHIFT + 8)) == tl.load(prefix_ptr + row))
    digit = tl.where(match, (key >> SHIFT) & 0xFF, 256).to(tl.int32)    # bin 256 and up: not counted
    counts = tl.histogram(digit, 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + row * 256 + bins, counts, mask=(bins < 256) & (counts > 0), sem="relaxed")


@triton.jit
def _pick(hist_ptr, active_ptr, prefix_ptr, left_ptr, n, FIRST: tl.constexpr):
    """Program row: the bin where the count from the top reaches the entries still to choose becomes the prefix's
    next digit; the entries above it are chosen. Clears the bins for the next round."""
    row = tl.program_id(0)
    if tl.load(active_ptr + row) == 0:
        return
    bins = tl.arange(0, 256)
    counts = tl.load(hist_ptr + row * 256 + bins).to(tl.int64)
    left = n if FIRST else tl.load(left_ptr + row)
    from_top = tl.sum(counts) - tl.cumsum(counts) + counts     # entries in this bin or above
    digit = tl.max(tl.where(from_top >= left, bins, -1))
    above = tl.sum(tl.where(bins > digit, counts, 0))
    prefix = 0 if FIRST else tl.load(prefix_ptr + row)
    tl.store(prefix_ptr + row, prefix * 256 + digit)
    tl.store(left_ptr + row, left - above)
    tl.store(hist_ptr + row * 256 + bins, tl.zeros([256], tl.int32))


@triton.jit
def _gather(logits_ptr, stride, vocab, active_ptr, prefix_ptr, left_ptr, taken_ptr, out_ptr, n,
            KEY_BITS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (row, chunk): the chunk's entries above the n-th largest key into slots ``0 .. n - left - 1`` of the
    row, and equal ones into the ``left`` slots after them while any is free."""
    row = tl.program_id(0)
    if tl.load(active_ptr + row) == 0:
        return
    value, key, mask = _chunk(logits_ptr, row, tl.program_id(1), stride, vocab, KEY_BITS, CHUNK)
    threshold, left = tl.load(prefix_ptr + row), tl.load(left_ptr + row)
    above = (mask & (key > threshold)).to(tl.int32)
    equal = (mask & (key == threshold)).to(tl.int32)
    n_above, n_equal = tl.sum(above), tl.sum(equal)
    base_above = tl.atomic_add(taken_ptr + row * 2, n_above, sem="relaxed")
    base_equal = tl.atomic_add(taken_ptr + row * 2 + 1, n_equal, sem="relaxed")
    slot_above = base_above + tl.cumsum(above) - above
    slot_equal = base_equal + tl.cumsum(equal) - equal
    tl.store(out_ptr + row * n + slot_above, value, mask=above > 0)
    tl.store(out_ptr + row * n + (n - left) + slot_equal, value, mask=(equal > 0) & (slot_equal < left))


@triton.jit
def _sort(out_ptr, active_ptr, n, N_POW2: tl.constexpr):
    """Program row: the row's n candidates, descending; ``-inf`` in a row that is not active."""
    row = tl.program_id(0)
    slots = tl.arange(0, N_POW2)
    inside = slots < n
    values = tl.load(out_ptr + row * n + slots, mask=inside, other=float("-inf"))
    if tl.load(active_ptr + row) == 0:
        values = tl.full([N_POW2], float("-inf"), tl.float32)
    tl.store(out_ptr + row * n + slots, tl.sort(values, descending=True), mask=inside)


def top_candidates(logits: torch.Tensor, n: int, active: torch.Tensor) -> torch.Tensor:
    """Each ``active`` row's ``n`` largest logits, descending, as float32 ``[S, n]`` (the values ``torch.topk``
    gives); ``-inf`` in the other rows."""
    rows, vocab = logits.shape
    key_bits = 8 * logits.element_size()
    if key_bits not in (16, 32) or logits.stride(1) != 1 or not 1 <= n <= vocab:
        raise ValueError(f"logits must be a row-major bf16/fp16/fp32 [S, V] with 1 <= n <= V (got {logits.dtype}, "
                         f"{tuple(logits.shape)}, n={n})")
    active = active.to(torch.int32)
    hist = torch.zeros(rows, BINS, dtype=torch.int32, device=logits.device)
    prefix, left = (torch.zeros(rows, dtype=torch.int64, device=logits.device) for _ in range(2))
    taken = torch.zeros(rows, 2, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, n, dtype=torch.float32, device=logits.device)
    grid = (rows, triton.cdiv(vocab, CHUNK))
    for shift in range(key_bits - 8, -1, -8):
        _histogram[grid](logits, logits.stride(0), vocab, active, prefix, hist, SHIFT=shift, KEY_BITS=key_bits,
                         CHUNK=CHUNK)
        _pick[(rows,)](hist, active, prefix, left, n, FIRST=shift == key_bits - 8)
    _gather[grid](logits, logits.stride(0), vocab, active, prefix, left, taken, out, n, KEY_BITS=key_bits,
                  CHUNK=CHUNK)
    _sort[(rows,)](out, active, n, N_POW2=triton.next_power_of_2(n))
    return out


def reference(logits: torch.Tensor, n: int, active: torch.Tensor) -> torch.Tensor:
    return torch.where(active[:, None], torch.topk(logits, n, dim=1).values.float(), float("-inf"))


def check(device: str, rows: int, vocab: int, n: int) -> list[str]:
    """Mismatches against ``torch.topk`` over rows of random, tied and extreme logits, in every dtype."""
    wrong = []
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = torch.randn(rows, vocab, generator=generator).mul(4).to(dtype)
        logits[0, : vocab // 2] = 1.0                      # a tie wider than n
        if rows > 1:
            logits[1] = torch.randint(-3, 3, (vocab,), generator=generator).to(dtype)   # ties everywhere
            logits[1, 0] = float("-inf")
        if rows > 2:
            logits[2, :7] = torch.tensor([float("inf"), 0.0, -0.0, 65000, -65000, 1e-7, -1e-7]).to(dtype)
        if rows > 3:
            logits[3, -n:] = 1000.0                        # exactly n in the top bin: the pick's boundary
        active = torch.rand(rows, generator=generator) < 0.7
        active[:4] = True
        logits, active = logits.to(device), active.to(device)
        got, want = top_candidates(logits, n, active), reference(logits, n, active)
        if not torch.equal(got, want):
            bad = (got != want).any(dim=1).nonzero()[:, 0].tolist()
            wrong.append(f"{dtype} rows {bad[:8]}")
    return wrong


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "topk_select_bench.json"))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--check-only", action="store_true", help="the check alone, on small rows (CPU: interpret)")
    args = parser.parse_args()
    if args.check_only:
        wrong = check("cuda" if torch.cuda.is_available() else "cpu", rows=5, vocab=3 * CHUNK - 5, n=1000)
        sys.exit(f"top_candidates differs from torch.topk: {wrong}" if wrong else print("check: equal to torch.topk"))
    from bench.gpu_timing import graph_ms

    wrong = check("cuda", rows=64, vocab=VOCAB, n=CANDIDATES) + check("cuda", rows=3, vocab=1000, n=1000)
    print("check:", wrong or "equal to torch.topk in every dtype", flush=True)
    results = []
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, device="cuda").mul(4).bfloat16()
        topk_us = graph_ms(lambda: torch.topk(logits, CANDIDATES, dim=1), args.reps) * 1e3
        entry = dict(rows=rows, topk_us=topk_us)
        for name, live in (("all", rows), ("one", 1), ("none", 0)):
            active = torch.arange(rows, device="cuda") < live
            entry[f"select_{name}_us"] = graph_ms(lambda: top_candidates(logits, CANDIDATES, active), args.reps) * 1e3
        results.append(entry)
        print(f"{rows:4d} rows: torch.topk {topk_us:7.1f} us; select: all active {entry['select_all_us']:7.1f}, one "
              f"{entry['select_one_us']:7.1f}, none {entry['select_none_us']:7.1f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       chunk=CHUNK, check=wrong, rows=results), f, indent=2)
    if wrong:
        sys.exit(f"top_candidates differs from torch.topk: {wrong}")


if __name__ == "__main__":
    main()
