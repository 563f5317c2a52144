"""Does the GEMV-shaped MoE (``blink.models.kernels.moe_skinny``) beat the expert blocks at decode sizes? At bf16 and
with FP8 experts (per-row scales, as ``--quantization fp8`` makes them).

At one token the fused MoE (``blink.models.kernels.moe``) pads each expert's single row to a 16-row block, sorts the
entries with an alignment kernel first, sums each token's top-k rows in a launch of its own, and with FP8 experts
quantizes ``x`` and the gated products in two more. ``moe_skinny`` has none of these: one program per (entry, output
tile) for gate/up with SiLU-and-mul, one per (token, output tile) for down, the routing weight and the combine, the
activations as they are. Each entry reads its expert's weights itself, so at more tokens an expert chosen twice is read
twice (from L2 if it is still there): the point is where it stops paying. The step takes it for FP8 experts up to one
entry per ``moe.SKINNY_EXPERTS_PER_ENTRY`` experts (``moe.takes_skinny``); this bench is what that rule rests on.

For tokens 1, 2, 4 and 8 (random router logits, near-uniform routing), at bf16 and FP8: the expert blocks
(``moe_experts`` at ``tiles_for``'s shape, the quantizations included) and ``moe_skinny`` with its gate/up launch at
every shape of ``SWEEP`` (the first is its default, ``skinny_moe_tiles``; the down launch takes ``down_tiles``),
routing included in both, each checked against ``reference.fused_moe`` first (relative error < 1e-2) and timed as
``CALLS`` layers in one graph, each with its own input and routing (so the experts hit differ between calls, as
between a step's layers, and L2 does not serve them), per layer; the floor is the bytes of the experts hit at the
measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.moe_decode_bench [--out moe_decode_bench.json]`` (``$OUT/...``
when ``$OUT`` is set).
"""
from __future__ import annotations

import itertools
import json
import sys
from dataclasses import asdict

import torch

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err, sweep_timed
from bench.moe_bench import layer_weights
from blink.models.e4m3 import quantize_rows
from blink.models.kernels import reference
from blink.models.kernels.fp8_skinny import SkinnyTiles
from blink.models.kernels.moe import moe_experts, route, tiles_for
from blink.models.kernels.moe_skinny import skinny_moe
from blink.models.shapes import shape_config

TOKENS = (1, 2, 4, 8)
CALLS = 8
SWEEP = [None] + [SkinnyTiles(block_n=n, block_k=k, num_warps=w, num_stages=3)
                  for n, k, w in itertools.product((16, 32), (64, 128, 256), (4, 8)) if n * k <= 4096]


def bench_tokens(tokens: int, experts_weights: tuple, scales: tuple, top_k: int, bw: float, reps: int) -> dict:
    """``experts_weights`` (gate_up, down) in bf16 or e4m3 with ``scales`` (gate_up's, down's, or two Nones)."""
    gate_up, down = experts_weights
    experts, two_i, hidden = gate_up.shape
    fp8 = scales[0] is not None
    calls = [(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
              torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)) for _ in range(CALLS)]
    want = reference.fused_moe(*calls[0], gate_up, down, top_k, True, *scales)
    hit = sum(reference.route(logits, top_k, True)[1].unique().numel() for _, logits in calls) / CALLS
    floor_us = hit * 3 * hidden * (two_i // 2) * (1 if fp8 else 2) / bw * 1e6
    tiles = tiles_for(tokens * top_k, experts)

    def blocks(x, logits):
        return moe_experts(x, *route(logits, top_k, True), gate_up, down, tiles, *scales)

    def skinny(x, logits, shape):
        return skinny_moe(x, *route(logits, top_k, True), gate_up, down, *scales, None, shape)

    blocks_err = rel_err(blocks(*calls[0]), want)
    blocks_us = graph_ms(lambda: [blocks(*c) for c in calls], reps) * 1e3 / CALLS
    shapes = [dict(tiles=t) for t in SWEEP]
    results, best = sweep_timed(shapes, lambda s: rel_err(skinny(*calls[0], s["tiles"]), want),
                                lambda s, i: skinny(*calls[i], s["tiles"]), CALLS, reps)
    for r in results:
        r["tiles"] = None if r["tiles"] is None else asdict(r["tiles"])
    default = results[0]["us"]
    print(f"{'fp8' if fp8 else 'bf16'}, {tokens} tokens ({hit:.1f} experts hit): floor {floor_us:6.2f} us  blocks "
          f"{blocks_us:6.2f} (x{blocks_us / floor_us:.2f}, err {blocks_err:.1e})  skinny " +
          ("WRONG" if default is None else f"{default:6.2f} (x{default / floor_us:.2f})") +
          (f", best {best['us']:6.2f} {best['tiles']}" if best else ""), flush=True)
    for r in results:
        if r["us"] is None:
            print(f"    {'does not fit' if r['error'] else 'WRONG'}: {r}", flush=True)
    return dict(dtype="fp8" if fp8 else "bf16", tokens=tokens, experts_hit=hit, floor_us=floor_us,
                blocks_us=blocks_us, blocks_rel_err=blocks_err, skinny_us=default, best=best, sweep=results)


def main():
    args, bw, _ = kernel_bench_start(__doc__, "moe_decode_bench.json", reps=20, sweep=False)
    c = shape_config("qwen3-30b-a3b")
    bf16 = layer_weights(c)
    fp8 = [quantize_rows(w) for w in bf16]
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; Qwen3-30B-A3B MoE layer, {CALLS} layers per "
          "graph", flush=True)
    rows = [bench_tokens(tokens, weights, scales, c.num_experts_per_tok, bw, args.reps) for tokens in TOKENS
            for weights, scales in ((bf16, (None, None)), ([w for w, _ in fp8], [s for _, s in fp8]))]
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw, rows=rows), f,
                  indent=2)
    wrong = [(r["dtype"], r["tokens"]) for r in rows for s in r["sweep"] if s["error"] is None and
             not s["rel_err"] < 1e-2]
    if wrong:
        sys.exit(f"moe_skinny differs from the reference at {sorted(set(wrong))} (relative error >= 1e-2)")


if __name__ == "__main__":
    main()
