"""Does the FP8 SiLU-and-multiply (products quantized per token) go faster with its row read twice in smaller blocks?

``activation.silu_and_mul(x, e4m3_group=n)`` gives an FP8 down projection its input: one program a row (a token's
scale needs all its products), which holds the whole row of Qwen3-8B's 12,288 products at once (16,384 columns, 16
warps) and reads it once. In a 2048-token FP8 prefill step on an H100 it took 3.9-4.1 ms of 36 against the bf16
kernel's 1.7 ms (many programs of 1,024 columns each). The other launch the kernel has (``GROUP`` 0: the row's largest
product first, then the products again from cache) takes smaller blocks and fewer warps, so more rows run on an SM at
once. Here both are timed at 1, 64, 256 and 2048 tokens, each shape checked to give the same codes and scales as the
default, beside the bf16 kernel; per call, the medians of graph replays of ``CALLS`` calls on ``CALLS`` inputs.

Run: ``PYTHONPATH=src python3 -m bench.experiments.silu_e4m3_bench [--out silu_e4m3_bench.json]`` (in the
directory ``OUT`` names, when set).
"""
from __future__ import annotations

import json

import torch

from bench.gpu_timing import graph_ms, kernel_bench_start
from blink.models.kernels.activation import _silu_and_mul_e4m3_kernel, silu_and_mul
from blink.models.kernels.pdl import pdl_args

COLUMNS = 12288  # Qwen3-8B's intermediate size
CALLS = 36       # its layers
TOKENS = (1, 64, 256, 2048)
# (GROUP, BLOCK, warps): the default first (a whole row held at once), then the row read twice in BLOCK columns.
SHAPES = ((16384, 16384, 16), (16384, 16384, 32), (0, 8192, 16), (0, 4096, 8), (0, 2048, 4), (0, 4096, 4),
          (0, 1024, 4))


def launch(x: torch.Tensor, group: int, block: int, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty((x.shape[0], COLUMNS), dtype=torch.uint8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _silu_and_mul_e4m3_kernel[(x.shape[0],)](x, codes, scale, COLUMNS, 1, GROUP=group, BLOCK=block, num_warps=warps,
                                             **pdl_args(x.device))
    return codes, scale


def bench(tokens: int, reps: int) -> dict:
    xs = [torch.randn(tokens, 2 * COLUMNS, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    want = silu_and_mul(xs[0], e4m3_group=COLUMNS)
    row = dict(tokens=tokens, bf16_us=graph_ms(lambda: [silu_and_mul(x) for x in xs], reps) * 1e3 / CALLS, shapes=[])
    print(f"{tokens:5d} tokens: bf16 SiLU-and-multiply {row['bf16_us']:7.1f} us", flush=True)
    for group, block, warps in SHAPES:
        codes, scale = launch(xs[0], group, block, warps)
        same = torch.equal(codes, want.values.view(torch.uint8)) and torch.equal(scale, want.scales)
        us = graph_ms(lambda: [launch(x, group, block, warps) for x in xs], reps) * 1e3 / CALLS
        row["shapes"].append(dict(group=group, block=block, num_warps=warps, same=same, call_us=us))
        print(f"{'':13s}GROUP={group:5d} BLOCK={block:5d} warps={warps:2d} {us:7.1f} us"
              f"{'' if same else '  DIFFERS from the default'}", flush=True)
    return row


def main():
    args, bw, _ = kernel_bench_start(__doc__, "silu_e4m3_bench.json", reps=20, sweep=False)
    rows = [bench(tokens, args.reps) for tokens in TOKENS]
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw, rows=rows), f,
                  indent=2)


if __name__ == "__main__":
    main()
