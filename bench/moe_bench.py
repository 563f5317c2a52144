"""The fused MoE kernel on one GPU: correctness against the torch reference at bf16, then speed against its floors.

One Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of width 768, top-8, renormalised; random bf16 weights and
``randn`` router logits, which route near-uniformly) at 1..2048 tokens. Each size first checks ``fused_moe`` against
``reference.fused_moe`` (relative error of the output < 1e-2; exits non-zero otherwise), then times the fused MLP
captured in a CUDA graph (median of CUDA-event-timed replays). Floors: the bytes of the experts actually hit (counted
from the routing) at the measured HBM copy rate, and the experts' FLOPs (``top_k`` per token) at the measured bf16
GEMM rate. ``reference_ms`` times the eager reference (one GEMM pair per hit expert, host-synchronising: the
baseline a plain torch model step would have).

``--sweep`` then times the expert GEMMs (routing done once, outside the graph) with every launch shape of ``SWEEP``
at each size, each checked against the reference first, and prints the fastest against the default ``tiles_for``.
``--profile 1 8`` last breaks the fused MLP at those token counts down per kernel (routing, alignment, the two expert
GEMMs, the combine): GPU time per call and the time no kernel runs.

Run: ``PYTHONPATH=src python3 -m bench.moe_bench [--sweep] [--profile 1 8] [--out moe_bench.json]``
(``$OUT/moe_bench.json`` by default when ``$OUT`` is set). Correctness tests of the kernels:
``tests/models/kernels/test_moe.py`` (``-m gpu`` at bf16).
"""
from __future__ import annotations

import itertools
import json
import sys
from dataclasses import asdict

import torch
from triton.runtime.errors import OutOfResources

from bench.gpu_timing import capture_graph, events_median_ms, graph_ms, kernel_bench_start, kernel_profile, rel_err
from blink.models.kernels import reference
from blink.models.kernels.moe import Tiles, fused_moe, moe_experts, route, tiles_for
from blink.models.shapes import shape_config

TOKENS = (1, 8, 64, 256, 1024, 2048)
# Narrow output tiles and long K steps too: at one token the default's 96 programs stream 512 KB each, fewer than SMs.
SWEEP = [Tiles(m, n, k, warps, stages) for m, n, k, warps, stages in
         itertools.product((16, 64), (16, 32, 64, 128), (64, 128, 256), (4, 8), (3,))]


def inputs(tokens: int, hidden: int, experts: int):
    return (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16))


def bench_tokens(tokens: int, weights, top_k: int, bw: float, flops: float, reps: int) -> dict:
    gate_up, down = weights
    experts, two_i, hidden = gate_up.shape
    x, logits = inputs(tokens, hidden, experts)
    want = reference.fused_moe(x, logits, gate_up, down, top_k, True)
    err = rel_err(fused_moe(x, logits, gate_up, down, top_k, True), want)
    hit = reference.route(logits, top_k, True)[1].unique().numel()
    ms = graph_ms(lambda: fused_moe(x, logits, gate_up, down, top_k, True), reps)
    reference_ms = events_median_ms(lambda: reference.fused_moe(x, logits, gate_up, down, top_k, True), 5)
    expert_bytes = 3 * hidden * (two_i // 2) * 2
    hbm_floor = hit * expert_bytes / bw * 1e3
    flop_floor = 2 * tokens * top_k * 3 * hidden * (two_i // 2) / flops * 1e3
    floor = max(hbm_floor, flop_floor)
    return dict(tokens=tokens, experts_hit=hit, rel_err=err, fused_ms=ms, reference_ms=reference_ms, floor_ms=floor,
                hbm_floor_ms=hbm_floor, flop_floor_ms=flop_floor, ratio=ms / floor)


def sweep_tokens(tokens: int, weights, top_k: int, reps: int) -> list[dict]:
    """The expert GEMMs alone (routing computed once) with every launch shape of ``SWEEP``; a shape whose output is
    not the reference's (relative error >= 1e-2) is reported and not timed."""
    gate_up, down = weights
    x, logits = inputs(tokens, gate_up.shape[2], gate_up.shape[0])
    want = reference.fused_moe(x, logits, gate_up, down, top_k, True)
    routing = route(logits, top_k, True)
    rows = []
    for tiles in SWEEP:
        try:
            err = rel_err(moe_experts(x, *routing, gate_up, down, tiles), want)
        except OutOfResources as e:  # the tiles need more shared memory than an SM has
            rows.append(dict(tokens=tokens, **asdict(tiles), rel_err=None, experts_ms=None,
                             error=str(e).splitlines()[0]))
            continue
        ms = graph_ms(lambda tiles=tiles: moe_experts(x, *routing, gate_up, down, tiles), reps) \
            if err < 1e-2 else None
        rows.append(dict(tokens=tokens, **asdict(tiles), rel_err=err, experts_ms=ms, error=None))
    default = asdict(tiles_for(tokens * top_k, gate_up.shape[0]))
    timed = sorted((r for r in rows if r["experts_ms"] is not None), key=lambda r: r["experts_ms"])
    base = next(r["experts_ms"] for r in rows if all(r[k] == v for k, v in default.items()))
    print(f"  sweep, {tokens} tokens: default {default} {'wrong' if base is None else f'{base:.4f} ms'}; fastest:",
          flush=True)
    for r in timed[:3]:
        print(f"    {r['experts_ms']:.4f} ms  block_m={r['block_m']} block_n={r['block_n']} block_k={r['block_k']} "
              f"warps={r['num_warps']} stages={r['num_stages']}", flush=True)
    for r in rows:
        if r["experts_ms"] is None:
            print(f"    {'does not fit' if r['error'] else 'WRONG'}: {r}", flush=True)
    return rows


def profile_tokens(tokens: int, weights, top_k: int, reps: int) -> dict:
    """The fused MLP at ``tokens`` (routing included, as a step runs it) broken down per kernel."""
    gate_up, down = weights
    x, logits = inputs(tokens, gate_up.shape[2], gate_up.shape[0])
    graph = capture_graph(lambda: fused_moe(x, logits, gate_up, down, top_k, True))
    ms = events_median_ms(graph.replay, reps)
    print(f"  profile, {tokens} tokens: {ms:.4f} ms", flush=True)
    return dict(tokens=tokens, **kernel_profile(graph, ms))


def layer_weights(c) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 expert weights of one MoE layer of config ``c``: (gate_up ``[E, 2I, H]``, down ``[E, H, I]``),
    scaled so that each GEMM's outputs are of order 1."""
    return (torch.randn(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size, device="cuda",
                        dtype=torch.bfloat16) * c.hidden_size ** -0.5,
            torch.randn(c.num_experts, c.hidden_size, c.moe_intermediate_size, device="cuda",
                        dtype=torch.bfloat16) * c.moe_intermediate_size ** -0.5)


def main():
    args, bw, flops = kernel_bench_start(__doc__, "moe_bench.json", reps=50, profile=True)
    c = shape_config("qwen3-30b-a3b")
    weights = layer_weights(c)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {flops / 1e12:.0f} TFLOP/s; "
          f"Qwen3-30B-A3B MoE layer: {c.num_experts} experts {c.hidden_size}x{c.moe_intermediate_size}, "
          f"top-{c.num_experts_per_tok}", flush=True)
    print(f"{'tokens':>6} {'hit':>4} {'rel err':>8} {'fused ms':>9} {'ref ms':>8} {'floor ms':>9} {'ratio':>6}")
    rows = []
    for tokens in TOKENS:
        r = bench_tokens(tokens, weights, c.num_experts_per_tok, bw, flops, args.reps)
        rows.append(r)
        print(f"{tokens:6d} {r['experts_hit']:4d} {r['rel_err']:8.1e} {r['fused_ms']:9.4f} {r['reference_ms']:8.3f} "
              f"{r['floor_ms']:9.4f} {r['ratio']:6.2f}", flush=True)
    sweep = [r for tokens in TOKENS for r in sweep_tokens(tokens, weights, c.num_experts_per_tok, args.reps)] \
        if args.sweep else []
    profiles = [profile_tokens(tokens, weights, c.num_experts_per_tok, args.reps) for tokens in args.profile]
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                       bf16_flop_per_s=flops, rows=rows, sweep=sweep, profiles=profiles), f, indent=2)
    bad = [r["tokens"] for r in rows + sweep if r.get("error") is None and not r["rel_err"] < 1e-2]
    if bad:
        sys.exit(f"fused_moe differs from the reference at {bad} tokens (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
