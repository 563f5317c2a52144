"""Where a step's GPU time goes, by kind of kernel: the per-kernel profiles of ``bench/model_bench.py --profile``
(blink) and ``bench/peers/vllm_step.py`` (vLLM) sorted into the same categories, so that two servers' steps of the
same model, batch and context compare category by category.

    PYTHONPATH=src python -m bench.kernel_split RESULT.json [RESULT.json ...] [--markdown]

Each file is a JSON with ``rows`` (both benches write that form); every row with a ``profile`` becomes one line:
GPU µs per step in each category, their sum (``busy``), the step's interval and, where the row has them, its board
power and joules per step. A kernel's category is the first of ``CATEGORIES`` whose pattern its name matches
(case-insensitive), else ``other``; ``--kernels`` also lists what fell into ``other``. Names are all there is to go
on, so the categories are approximate where a kernel does two things: blink's fused RoPE + KV-cache write counts as
rope, vLLM's KV-cache write (``reshape_and_cache_flash``) as attention, and torch.compile's fused kernels by the op
their name gives (``triton_red_fused_..._rsqrt`` as a norm).
"""
from __future__ import annotations

import argparse
import json
import re

# Order matters: the first match wins (a fused "rms_norm_rope" kernel counts as a norm, a MoE GEMM as moe).
# blink's ``_combine_kernel`` is its split-KV decode attention's merge of the partial outputs.
CATEGORIES = (
    ("moe", r"moe|expert"),
    ("attention", r"attention|attn|flash|fmha|paged|^_combine_kernel$"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|splitkreduce|_mm_|matmul"),
    ("norm", r"norm|rsqrt"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("sampling", r"topk|sort|gumbel|logsumexp|argmax|sampl|softmax|candidate|fold_chunks|penalt|scan"),
)
OTHER = "other"


def category(kernel: str) -> str:
    """The category of a kernel named ``kernel``: the first of ``CATEGORIES`` whose pattern it contains."""
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel, re.IGNORECASE):
            return name
    return OTHER


def split(kernels: list[dict]) -> dict[str, float]:
    """GPU µs per step per category (every category present, 0 where none ran) of a profile's ``kernels``
    (``{"kernel", "us_per_step"}`` records)."""
    totals = {name: 0.0 for name, _ in CATEGORIES} | {OTHER: 0.0}
    for k in kernels:
        totals[category(k["kernel"])] += k["us_per_step"]
    return totals


def lines(rows: list[dict]) -> list[dict]:
    """One record per profiled row: its label, the split, busy µs, step ms and (where measured) W and J per step."""
    out = []
    for row in rows:
        if "profile" not in row:
            continue
        totals = split(row["profile"]["kernels"])
        out.append({"label": f"{row.get('server', 'blink')} {row['model']} {row['kind']} B={row['batch']} "
                             f"ctx={row.get('context', '-')}",
                    "split": totals, "busy_us": sum(totals.values()), "step_ms": row["step_ms"],
                    "power_w": row.get("power_w"), "joules_per_step": row.get("joules_per_step")})
    return out


def table(records: list[dict], markdown: bool) -> str:
    names = [name for name, _ in CATEGORIES] + [OTHER]
    head = ["step"] + names + ["busy µs", "step ms", "W", "J / step"]
    rows = [[r["label"]] + [f"{r['split'][n]:.1f}" for n in names] + [f"{r['busy_us']:.1f}", f"{r['step_ms']:.3f}",
            "-" if r["power_w"] is None else f"{r['power_w']:.0f}",
            "-" if r["joules_per_step"] is None else f"{r['joules_per_step']:.4f}"] for r in records]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    width = max([len(head[0])] + [len(r[0]) for r in rows])
    fmt = lambda cells: f"{cells[0]:<{width}} " + " ".join(f"{c:>10}" for c in cells[1:])   # noqa: E731
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON files with profiled rows (model_bench, vllm_step)")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--kernels", action="store_true", help="also list the kernels that fell into 'other'")
    args = parser.parse_args()
    rows = []
    for path in args.results:
        with open(path) as f:
            rows += json.load(f)["rows"]
    print(table(lines(rows), args.markdown))
    if args.kernels:
        for row in rows:
            for k in row.get("profile", {}).get("kernels", []):
                if category(k["kernel"]) == OTHER:
                    print(f"other: {k['us_per_step']:9.1f} us  {k['kernel'][:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
