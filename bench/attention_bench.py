"""The paged attention kernel on one GPU: correctness against the torch reference at bf16, then speed against its
floors, at the default launch shape and (``--sweep``) at every shape of ``PREFILL_SWEEP`` / ``DECODE_SWEEP`` /
``SPECULATION_SWEEP``.

Llama-3-8B's attention (32 query heads, 8 KV heads of 128, pages of 16 tokens scattered over the pool) in the step's
cases: a 2048-token prompt, a 512-token chunk on a 1536-token cached prefix, decodes (one token per sequence) at
batch 1, 16 and 64 with 1K context and batch 1 and 16 with 8K, and with speculation (a layout whose
``decode_query_len`` is 5) decodes at batch 1, 16 and 64 and verifications of 4 drafts a sequence; and Qwen3-0.6B's
(16 query heads, a GQA group of 2) decodes at batch 64 and 256 with 256 tokens of context, the small-model step's
(``--cases`` picks some). Every case first checks the kernel against ``reference.attention`` (relative error < 1e-2;
exits non-zero otherwise), then times ``LAYERS`` back-to-back calls captured in one CUDA graph (as a step runs them)
and reports the time per call. Floors: the KV bytes read at the measured HBM copy rate, or the causal attention
FLOPs at the measured bf16 GEMM rate when larger. For a prompt with no cached prefix the same attention on
contiguous K/V by torch's ``scaled_dot_product_attention`` (its flash kernel) is timed the same way, as a yardstick
of what a dense kernel reaches on this GPU.

Run: ``PYTHONPATH=src python3 -m bench.attention_bench [--sweep] [--out attention_bench.json]`` (``$OUT/...`` by
default when ``$OUT`` is set). Correctness tests: ``tests/models/kernels/test_attention.py``.
"""
from __future__ import annotations

import itertools
import json
import random
import sys
from dataclasses import asdict, dataclass, replace

import torch
from triton.runtime.errors import OutOfResources

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err
from blink.device.step import StepBuffers, StepLayout
from blink.models.batch import SeqChunk, chunk_drafts, fill_step
from blink.models.kernels import reference
from blink.models.kernels.attention import Tiles, attention, attention_plan, tiles_for

KV_HEADS, DIM, PAGE = 8, 128, 16
LAYERS = 32
LAYOUT = StepLayout(max_num_batched_tokens=2048, max_num_seqs=256, max_pages_per_seq=8192 // PAGE)
# 96 shapes (each compiled once, then timed per case).
PREFILL_SWEEP = [dict(tiles=Tiles(rows, n, warps, stages)) for rows, n, warps, stages in
                 itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
DECODE_SWEEP = [dict(tiles=Tiles(16, n, 4, stages), num_splits=splits) for n, stages, splits in
                itertools.product((32, 64, 128), (2, 3, 4), (1, 2, 4, 8, 16, 32, 64, 128))]
# 36 shapes for the cases of a layout with drafts: a block of 16 rows holds 4 of a verification's 5 tokens.
SPECULATION_SWEEP = [dict(tiles=Tiles(rows, 64, 4, stages), num_splits=splits) for rows, stages, splits in
                     itertools.product((16, 32, 64), (2, 3), (1, 2, 4, 8, 16, 32))]


@dataclass(frozen=True)
class Case:
    """``seqs`` sequences, each ``q_len`` query tokens on a cached prefix of ``prefix`` tokens, in a layout whose
    decoding sequences bring ``decode_query_len`` tokens (``StepLayout``'s: 5 where they may verify 4 drafts; a
    verification is one row a token, as the scheduler plans it, attention reading them as one chunk)."""

    name: str
    seqs: int
    q_len: int
    prefix: int
    decode_query_len: int = 1
    as_chunks: bool = False  # a verification given one row a sequence: no empty rows (not how the scheduler plans it)
    heads: int = 32  # query heads: Llama-3-8B's; 16 for Qwen3-0.6B's (both have 8 KV heads of 128)

    @property
    def tokens(self) -> int:
        return self.seqs * self.q_len

    @property
    def decode(self) -> bool:
        return self.q_len <= self.decode_query_len

    @property
    def layout(self) -> StepLayout:
        if not self.decode:
            return LAYOUT
        return replace(LAYOUT, max_num_seqs=self.seqs if self.as_chunks else max(LAYOUT.max_num_seqs, self.tokens),
                       decode_query_len=self.decode_query_len)


CASES = (Case("prefill 2048", 1, 2048, 0), Case("chunk 512 on 1536", 1, 512, 1536),
         Case("decode B=1 ctx 1K", 1, 1, 1023), Case("decode B=16 ctx 1K", 16, 1, 1023),
         Case("decode B=64 ctx 1K", 64, 1, 1023), Case("decode B=1 ctx 8K", 1, 1, 8191),
         Case("decode B=16 ctx 8K", 16, 1, 8191),
         *(Case(f"{kind} B={seqs} ctx 1K drafts 4", seqs, q_len, 1024 - q_len, 5)
           for kind, q_len in (("decode", 1), ("verify", 5)) for seqs in (1, 16, 64)),
         Case("verify B=64 ctx 1K drafts 4 as chunks", 64, 5, 1019, 5, as_chunks=True),
         *(Case(f"qwen3-0.6b decode B={seqs} ctx 256", seqs, 1, 255, heads=16) for seqs in (64, 256)))


def inputs(case: Case, layers: int = LAYERS):
    """Step buffers of the case (pages scattered over a pool just large enough), q, and ``layers`` KV pools: each
    call reads its own, as each layer of a step does (one pool would be served from L2 after the first call)."""
    per_seq = -(-(case.prefix + case.q_len) // PAGE)
    pages = list(range(case.seqs * per_seq))
    random.Random(0).shuffle(pages)
    seq_pages = [pages[i * per_seq:(i + 1) * per_seq] for i in range(case.seqs)]
    buf = StepBuffers(case.layout, "cuda")
    if case.decode and case.q_len > 1 and not case.as_chunks:  # one row a token, attention's view a chunk a sequence
        fill_step(buf, [SeqChunk([1], case.prefix + j, p) for p in seq_pages for j in range(case.q_len)], PAGE)
        chunk_drafts(buf, [(i * case.q_len, (i + 1) * case.q_len) for i in range(case.seqs)])
    else:
        fill_step(buf, [SeqChunk([1] * case.q_len, case.prefix, p) for p in seq_pages], PAGE)
    q = torch.randn(case.tokens, case.heads, DIM, device="cuda", dtype=torch.bfloat16)
    caches = torch.randn(layers, 2, len(pages), PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return buf, q, caches


def floors_ms(case: Case, bw: float, flops: float) -> tuple[float, float]:
    """(KV bytes read / copy rate, causal attention FLOPs / GEMM rate) of one call."""
    context = case.prefix + case.q_len
    kv_bytes = case.seqs * context * KV_HEADS * DIM * 2 * 2
    visible = case.seqs * sum(case.prefix + i + 1 for i in range(case.q_len))
    return kv_bytes / bw * 1e3, 4 * case.heads * DIM * visible / flops * 1e3


def run(case: Case, data, reps: int, want: torch.Tensor, **shape) -> dict:
    """Checks one launch shape against ``want``, then times it (not when it is wrong or does not fit the SM)."""
    buf, q, caches = data
    try:
        plan = attention_plan(buf, case.tokens, case.heads, KV_HEADS, DIM, PAGE, torch.bfloat16, **shape)
        err = rel_err(attention(q, caches[0], plan, DIM ** -0.5), want)
    except OutOfResources as e:
        return dict(**describe(shape), rel_err=None, call_us=None, error=str(e).splitlines()[0])

    def layers():
        for cache in caches:
            attention(q, cache, plan, DIM ** -0.5)

    us = graph_ms(layers, reps) * 1e3 / LAYERS if err < 1e-2 else None
    return dict(**describe(shape), num_splits_used=plan.num_splits, rel_err=err, call_us=us, error=None)


def sdpa_us(case: Case, reps: int) -> float:
    """Causal GQA attention of one prompt over contiguous K/V (``LAYERS`` copies) by torch's flash kernel, per call."""
    q = torch.randn(1, case.heads, case.q_len, DIM, device="cuda", dtype=torch.bfloat16)
    kvs = torch.randn(LAYERS, 2, 1, KV_HEADS, case.q_len, DIM, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return graph_ms(lambda: [sdpa(q, k, v, is_causal=True, enable_gqa=True) for k, v in kvs], reps) * 1e3 / LAYERS


def describe(shape: dict) -> dict:
    return {**asdict(shape["tiles"]), "num_splits": shape.get("num_splits")} if "tiles" in shape else {}


def bench_case(case: Case, bw: float, flops: float, reps: int, sweep: bool) -> dict:
    data = inputs(case)
    buf, q, caches = data
    ref_plan = reference.attention_plan(buf, case.tokens, case.heads, KV_HEADS, DIM, PAGE)
    want = reference.attention(q, caches[0], ref_plan, DIM ** -0.5)
    hbm, flop = floors_ms(case, bw, flops)
    floor_us = max(hbm, flop) * 1e3
    layout = case.layout
    default = {**run(case, data, reps, want),
               **asdict(tiles_for(case.tokens, layout.max_num_seqs, layout.decode_query_len))}
    row = dict(case=case.name, heads=case.heads, seqs=case.seqs, q_len=case.q_len, prefix=case.prefix,
               floor_us=floor_us, hbm_floor_us=hbm * 1e3, flop_floor_us=flop * 1e3, default=default, sweep=[],
               sdpa_us=sdpa_us(case, reps) if case.prefix == 0 and not case.decode else None)
    print(f"{case.name:>20}  default {fmt(default)}  floor {floor_us:8.1f} us  "
          f"x{default['call_us'] / floor_us:.2f}" if default["call_us"] else f"{case.name}: default WRONG {default}",
          f"  torch flash (contiguous K/V) {row['sdpa_us']:.1f} us" if row["sdpa_us"] else "", flush=True)
    if sweep:
        row["sweep"] = [run(case, data, reps, want, **shape) for shape in
                        (PREFILL_SWEEP if not case.decode else
                                         DECODE_SWEEP if case.decode_query_len == 1 else SPECULATION_SWEEP)]
        timed = sorted((r for r in row["sweep"] if r["call_us"] is not None), key=lambda r: r["call_us"])
        for r in timed[:3]:
            print(f"{'':>20}  {fmt(r)}  x{r['call_us'] / floor_us:.2f}  {describe_row(r)}", flush=True)
        for r in row["sweep"]:
            if r["call_us"] is None:
                print(f"{'':>20}  {'WRONG' if r['error'] is None else 'does not fit'}: {describe_row(r)} "
                      f"{r['error'] or r['rel_err']}", flush=True)
    return row


def fmt(r: dict) -> str:
    return f"{r['call_us']:8.1f} us (rel err {r['rel_err']:.1e})"


def describe_row(r: dict) -> str:
    return (f"query_rows={r['query_rows']} block_n={r['block_n']} warps={r['num_warps']} stages={r['num_stages']}"
            f" splits={r.get('num_splits_used')}")


def main():
    args, bw, flops = kernel_bench_start(__doc__, "attention_bench.json", reps=30, cases=[c.name for c in CASES])
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {flops / 1e12:.0f} TFLOP/s; "
          f"attention of {KV_HEADS} KV heads of {DIM}, pages of {PAGE}; per call of {LAYERS} in a graph",
          flush=True)
    rows = []
    for case in (c for c in CASES if c.name in args.cases):
        rows.append(bench_case(case, bw, flops, args.reps, args.sweep))
        torch.cuda.empty_cache()  # the next case's KV pools
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                       bf16_flop_per_s=flops, layers=LAYERS, rows=rows), f, indent=2)
    wrong = [r["case"] for r in rows for x in [r["default"], *r["sweep"]]
             if x["error"] is None and not x["rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"attention differs from the reference in {sorted(set(wrong))} (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
