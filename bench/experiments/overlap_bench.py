"""Can the H200 run a decode step's memory-bound attention and compute-bound GEMMs at the same time? An experiment
for issue 4, not a step kernel.

At batch 256 and 1K context, Llama-3-8B's step is attention (8.2 ms of KV at the copy rate) plus weight GEMMs (4.9
ms of FLOPs at the GEMM rate) plus small kernels; the sum of the ops' rooflines is 1.11x the step's HBM floor, so
<= 1.10x needs the two kinds of work to overlap (NanoFlow-style nano-batches: one half of the batch in attention
while the other half is in its GEMMs). Here the batch is split in two halves of ``HALF`` sequences and, per layer
(``LAYERS``, each with its own weights and KV), the attention of one half and the four weight GEMMs (qkv, o_proj,
gate_up, down; cuBLAS) of the other are timed:

- ``attention`` / ``gemms``: each chain alone, one graph;
- ``serial``: both chains in one stream (what a step does now);
- ``concurrent``: the two chains on two streams of one graph (forked at the start, joined at the end), so the GPU
  may run an attention kernel and a GEMM at once.

The attention output is checked against the reference for one layer first. Times per layer.

Run: ``PYTHONPATH=src python3 -m bench.experiments.overlap_bench [--out overlap_bench.json]`` (``$OUT/...`` when
set).
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from bench.attention_bench import DIM, HEADS, KV_HEADS, PAGE, Case, inputs
from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err
from blink.models.kernels import reference
from blink.models.kernels.attention import attention, attention_plan

HIDDEN, QKV, INTER = 4096, 6144, 14336
HALF = 128
CONTEXT = 1024
LAYERS = 16


def gemm_inputs():
    def weight(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    layers = [(weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER))
              for _ in range(LAYERS)]
    x = torch.randn(HALF, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x, layers


def main():
    args, bw, flops = kernel_bench_start(__doc__, "overlap_bench.json", reps=20, sweep=False)
    buf, q, caches = inputs(Case("half batch", HALF, 1, CONTEXT - 1), LAYERS)  # scattered pages, a pool per layer
    plan = attention_plan(buf, HALF, HEADS, KV_HEADS, DIM, PAGE, torch.bfloat16)
    want = reference.attention(q, caches[0], reference.attention_plan(buf, HALF, HEADS, KV_HEADS, DIM, PAGE),
                               DIM ** -0.5)
    err = rel_err(attention(q, caches[0], plan, DIM ** -0.5), want)
    if not err < 1e-2:
        raise SystemExit(f"attention differs from the reference (relative error {err:.2e})")
    x, layers = gemm_inputs()

    def attention_chain():
        for cache in caches:
            attention(q, cache, plan, DIM ** -0.5)

    def gemm_chain():
        for qkv, o, gate_up, down in layers:
            F.linear(x, qkv)
            F.linear(x, o)
            F.linear(F.linear(x, gate_up)[:, :INTER], down)

    side = torch.cuda.Stream()

    def concurrent():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            gemm_chain()
        attention_chain()
        main_stream.wait_stream(side)

    def serial():
        attention_chain()
        gemm_chain()

    us = {name: graph_ms(fn, args.reps) * 1e3 / LAYERS for name, fn in
          (("attention", attention_chain), ("gemms", gemm_chain), ("serial", serial), ("concurrent", concurrent))}
    kv_bytes = HALF * CONTEXT * 2 * KV_HEADS * DIM * 2
    weight_bytes = sum(w.numel() * 2 for w in layers[0])
    floors = dict(attention_us=kv_bytes / bw * 1e6, gemm_bytes_us=weight_bytes / bw * 1e6,
                  gemm_flops_us=2 * HALF * sum(w.numel() for w in layers[0]) / flops * 1e6)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {flops / 1e12:.0f} TFLOP/s; "
          f"{HALF} sequences at {CONTEXT} context, {LAYERS} layers (attention rel err {err:.1e})", flush=True)
    print(f"floors per layer: attention KV {floors['attention_us']:.1f} us, GEMM bytes {floors['gemm_bytes_us']:.1f}"
          f" us, GEMM FLOPs {floors['gemm_flops_us']:.1f} us", flush=True)
    for name, t in us.items():
        print(f"  {name:>10}: {t:8.1f} us per layer", flush=True)
    print(f"  overlap: concurrent is {us['serial'] / us['concurrent']:.2f}x faster than serial; "
          f"{us['concurrent'] / max(us['attention'], us['gemms']):.2f}x the longer chain alone", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                       bf16_flop_per_s=flops, half=HALF, context=CONTEXT, layers=LAYERS, attention_rel_err=err,
                       us_per_layer=us, floors=floors), f, indent=2)


if __name__ == "__main__":
    main()
