"""Model-step speed on one GPU against the floors measured in the same run.

For the paper's four models at full size (``blink.models.shapes``: Llama-3-8B, Phi-4, Qwen3-32B, Qwen3-30B-A3B;
random bf16 weights; ``--models qwen3-8b`` adds the earlier Qwen3-8B shape): the graph-captured decode step at batch
1/16/64/256 with every sequence at context 1K and 8K, and a 2048-token prefill step. Floors: bytes the step must read
(weights + the KV it attends over) at the measured HBM copy rate; for prefill also its matmul FLOPs at the measured
bf16 GEMM rate. A MoE step reads only the experts its tokens are routed to: its weight bytes count the expected
share of experts hit by uniform routing, ``1 - (1 - top_k / E) ** tokens`` (random weights route near-uniformly),
and its FLOPs the ``top_k`` experts per token; of an untied embedding table a step reads only the rows it gathers.
Beside the floor, the roofline sums each big op's own roofline (``roofline_ms``): where GEMMs turn compute-bound
(large batches) it exceeds the HBM floor, and no sequence of kernels can beat it. Times are medians of
CUDA-event-timed graph replays after warm-up.

Every sequence gets its own pages, scattered over a pool of ``--kv-gib`` GiB at most (less when the memory plan of
``blink.models.memory`` leaves less beside the weights); a (batch, context) whose KV does not fit is skipped
(aliasing pages would let concurrent sequences share reads through L2 and beat the floor). For a dense model a
"gemms" row times the step's weight GEMMs alone (cuBLAS, same shapes, one graph): the part of the gap that is GEMM
efficiency rather than the other kernels and their launches (for the MoE kernel: ``bench/moe_bench.py``). Each model
also prints its memory plan against what it allocated.

Run: ``PYTHONPATH=src python3 -m bench.model_bench [--models llama-3-8b ...] [--profile 1,1024 prefill] [--drafts K]
[--out F]``
(writes ``$OUT/model_bench.json`` when ``$OUT`` is set). ``--profile B,CTX`` runs only the decode step at batch B and
context CTX (``prefill``: the prefill step), timed and then broken down per kernel: GPU time per step and the time
no kernel runs. Profiles run in a process of their own because graph replays after a CUPTI profile in the same process
are slower (docs/benchmarks/models.md, "Two corrections"). ``--power`` adds each decode step's and the prefill's board
power (NVML), the step replayed back to back from the host for 3 s (before any profile), and its joules per step and per
token: the kernels' own watts, to set beside a server's; and the same for the weight GEMMs alone (cuBLAS, at batches 1,
16, 64, 256), so that the step's energy splits into its GEMMs' and the rest's.
``--quantization fp8`` runs the same table with FP8 projections (random weights quantized per output row;
``--weight-block-size 128 128``: per 128x128 block, the layout of Qwen3's FP8 checkpoints), rows named
``<model>-fp8``: the floor then reads each projection's weights at one byte each plus its float32 scales (the
embeddings, LM head and router stay bf16, as does the KV cache); the roofline still takes the bf16 GEMM rate.
``--kv-cache-dtype fp8`` keeps the KV pool in e4m3 (rows named ``<model>-fp8kv``; the floors read K and V at a byte).
Correctness of what is timed: ``tests/models`` (``-m gpu`` on the GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch

from bench.gpu_timing import copy_bandwidth, events_median_ms, kernel_profile, matmul_rate, replay_power
from blink.bench.shapes import shape_config
from blink.config import KV_CACHE_DTYPES
from blink.device.step import StepBuffers, StepLayout
from blink.models import ModelConfig, plan_memory, random_model
from blink.models.batch import SeqChunk, chunk_drafts, fill_step
from blink.models.decoder import SparseMoE
from blink.models.memory import GIB, kv_cache_dtype, kv_page_bytes, weight_bytes
from blink.models.quantization import QUANTIZATIONS, Fp8Config, requested
from blink.models.shapes import SHAPES

MODELS = {name: shape_config(name) for name in (*SHAPES, "qwen3-8b")}
PAGE = 16
TEMPERATURE, TOP_P = 0.8, 0.95  # a decode row's sampling unless --greedy: every row filters
LAYOUT = StepLayout(max_num_batched_tokens=2048, max_num_seqs=256, max_pages_per_seq=8192 // PAGE)
# The steps verifying drafts (--drafts): 64 sequences verifying 4 each take 320 rows. Their own buffers (with the
# drafts' decode_query_len), so that the other steps keep LAYOUT's (a 2048-token prefill samples max_num_seqs rows).
DRAFTS_LAYOUT = replace(LAYOUT, max_num_seqs=512)
# The decode steps of the full table: (batch, context, bucket), each batch in a graph of its own size; ctx 256 is what
# serving's short chats see, where a small model's step is furthest above its floor.
GRID = [(batch, ctx, batch) for ctx in (256, 1024, 8192) for batch in (1, 16, 64, 256)]


def expert_bytes(model) -> int:
    return sum(weight_bytes(layer.mlp.experts) for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))


def hit_share(c: ModelConfig, tokens: int) -> float:
    """Expected share of a MoE layer's experts that ``tokens`` uniformly routed tokens hit."""
    return 1 - (1 - c.num_experts_per_tok / c.num_experts) ** tokens if c.num_experts else 0.0


def read_weight_bytes(model, tokens: int) -> float:
    """Weight bytes a step of ``tokens`` tokens reads: all, but of the experts only the expected share hit, and of
    an untied embedding table only the ``tokens`` rows it gathers (a tied one is the LM head: read whole)."""
    c, experts, embed = model.config, expert_bytes(model), model.model.embed_tokens.weight
    table = embed.numel() * embed.element_size()
    gathered = table if c.tie_word_embeddings else min(tokens, c.vocab_size) * c.hidden_size * embed.element_size()
    return weight_bytes(model) - table + gathered - experts + hit_share(c, tokens) * experts


def roofline_ms(model, tokens: int, sampled: int, kv_bytes: float, attn_flops: float, bw: float,
                flops: float) -> float:
    """The step's time if each of its big ops ran at its own roofline, one after another: the sum over the weight
    GEMMs (the MoE experts as one op), the attention and the LM head of max(bytes / copy rate, FLOPs / GEMM rate).
    Above the HBM floor wherever an op is compute-bound (large batches, prefill); the small kernels count 0."""
    c = model.config

    def op(nbytes: float, nflops: float) -> float:
        return max(nbytes / bw, nflops / flops)

    def gemm(w: torch.Tensor, rows: int) -> float:
        return op(w.numel() * w.element_size(), 2 * rows * w.numel())

    total = op(kv_bytes, attn_flops) + gemm(model.lm_head_weight(), sampled)
    for layer in model.model.layers:
        total += gemm(layer.self_attn.qkv_proj.weight, tokens) + gemm(layer.self_attn.o_proj.weight, tokens)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            expert_flops = 2 * tokens * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
            total += gemm(mlp.gate.weight, tokens) + op(hit_share(c, tokens) * weight_bytes(mlp.experts), expert_flops)
        else:
            total += gemm(mlp.gate_up_proj.weight, tokens) + gemm(mlp.down_proj.weight, tokens)
    return total * 1e3


def linear_flops_per_token(c: ModelConfig) -> int:
    attention = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    dense = 3 * c.hidden_size * c.intermediate_size
    moe = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size + c.num_experts * c.hidden_size
    return 2 * sum(attention + (moe if c.is_moe_layer(i) else dense) for i in range(c.num_layers))


def capture(model, buf, kv, tokens: int):
    """Warm up (compiles the kernels), capture the step for bucket ``tokens``, return a replay function."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(buf, kv, tokens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            model(buf, kv, tokens)
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    return graph


def decode_chunks(batch: int, ctx: int, num_pages: int, seed: int, drafts: int = 0,
                  greedy: bool = False) -> tuple[list[SeqChunk], list[tuple[int, int]]]:
    """``batch`` sequences decoding their token at position ``ctx - 1``, on distinct pages scattered over the pool,
    each verifying ``drafts`` speculative drafts after it (one row a token, as the scheduler plans them), sampling at
    ``TEMPERATURE`` with ``TOP_P`` (every row filters) or ``greedy`` (no row reads candidates, as the served
    benchmarks sample); and the rows of each sequence, ``(first, end)``, for ``chunk_drafts``."""
    per_seq = -(-(ctx + drafts) // PAGE)
    g = torch.Generator().manual_seed(seed)
    scattered = torch.randperm(num_pages, generator=g)[:batch * per_seq].view(batch, per_seq).tolist()
    chunks, groups = [], []
    for i, pages in enumerate(scattered):
        groups.append((len(chunks), len(chunks) + 1 + drafts))
        chunks += [SeqChunk([int(torch.randint(0, 1000, (1,), generator=g))], ctx - 1 + j, pages,
                            temperature=0.0 if greedy else TEMPERATURE, top_p=1.0 if greedy else TOP_P, seed=i)
                   for j in range(1 + drafts)]
    return chunks, groups


def gemm_weights(model) -> list[torch.Tensor]:
    """A dense model's weight GEMM operands, in step order: per layer qkv, o, gate/up, down; then the LM head."""
    return [w for layer in model.model.layers for w in (
        layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
        layer.mlp.down_proj.weight)] + [model.lm_head_weight()]


def gemm_weight_bytes(model) -> int:
    return sum(w.numel() * w.element_size() for w in gemm_weights(model))


def gemms_only_graph(model, batch: int) -> torch.cuda.CUDAGraph:
    """The step's weight GEMMs alone at ``batch`` rows (the LM head at one row per sequence), graph-captured: cuBLAS,
    as vLLM runs them, so their power beside the whole step's tells the rest of the step's kernels apart."""
    c = model.config
    x = {n: torch.randn(batch, n, device="cuda", dtype=model.dtype) for n in (c.hidden_size, c.q_size,
                                                                             c.intermediate_size)}
    weights = [(x[w.shape[1]], w) for w in gemm_weights(model)]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for a, w in weights:
            torch.nn.functional.linear(a, w)
        with torch.cuda.graph(graph, stream=stream):
            for a, w in weights:
                torch.nn.functional.linear(a, w)
    torch.cuda.synchronize()
    return graph


def add_power(row: dict, graph, label: str, tokens: int) -> None:
    """The board power of ``graph`` replayed back to back (``row``'s step of ``tokens`` tokens), its joules per step
    and per token."""
    watts = replay_power(graph.replay, row["step_ms"])
    if watts is None:
        return
    row.update(power_w=watts["mean_power_w"], joules_per_step=watts["joules_per_step"],
               joules_per_token=watts["joules_per_step"] / tokens)
    print(f"  {label}: {watts['mean_power_w']:.0f} W back to back, {watts['joules_per_step']:.4f} J per step, "
          f"{watts['joules_per_step'] / tokens:.4f} J per token", flush=True)


def bench_model(name: str, config: ModelConfig, bw: float, flops: float, kv_gib: float, reps: int,
                profile: set, power: bool = False, drafts: int = 0, kv_dtype_name: str = "auto",
                greedy: bool = False) -> list[dict]:
    """Every step of the table, or (``profile`` not empty) only the profiled ones; with ``power``, each decode step's
    and each weight-GEMMs-only graph's board power replayed back to back from the host (no scheduler) and its joules
    per step and per token; with ``drafts``, each decode step also with every sequence verifying that many
    speculative drafts; ``kv_dtype_name="fp8"``: the KV pool in e4m3 (``--kv-cache-dtype``)."""
    t0 = time.time()
    plan = plan_memory(config, torch.cuda.mem_get_info()[1], PAGE, 0.9, LAYOUT.max_num_batched_tokens,
                       LAYOUT.max_num_seqs)
    print(f"{name}: plan {plan.summary()}", flush=True)
    before = torch.cuda.memory_allocated()
    model = random_model(config, "cuda")
    wbytes = weight_bytes(model)
    print(f"{name}: allocated {(torch.cuda.memory_allocated() - before) / GIB:.2f} GiB for the model (plan: "
          f"{plan.weight_bytes / GIB:.2f} GiB of weights)", flush=True)
    buf = StepBuffers(LAYOUT, "cuda")
    drafts_buf = StepBuffers(replace(DRAFTS_LAYOUT, decode_query_len=1 + drafts), "cuda") if drafts else None
    kv_dtype = kv_cache_dtype(kv_dtype_name, model.dtype)
    page_bytes = kv_page_bytes(model, PAGE, kv_dtype)
    num_pages = min(int(kv_gib * GIB // page_bytes), plan.num_pages * plan.kv_page_bytes // page_bytes)
    kv = model.allocate_kv_cache(num_pages, PAGE, kv_dtype)
    for layer in kv:  # random K and V (drawn in the model dtype a layer at a time: e4m3 has no normal_)
        layer.copy_(torch.randn(layer.shape, device=layer.device, dtype=model.dtype))
    print(f"{name}: weights {wbytes / 1e9:.2f} GB, KV pool {num_pages} pages, setup {time.time() - t0:.1f}s",
          flush=True)
    rows = []
    cells = sorted((c for c in profile if c != "prefill"), key=lambda c: (c[1], c[0], c[2])) if profile else GRID
    for batch, ctx, bucket, k in ((*c, k) for c in cells for k in sorted({0, drafts})):
        label = (f"decode B={batch:4d} ctx={ctx:5d}" + (f" in the {bucket}-token graph" if bucket != batch else "")
                 + (f" verifying {k} drafts each" if k else ""))
        step, bucket = (drafts_buf if k else buf), max(bucket, batch * (1 + k))
        if batch * -(-(ctx + k) // PAGE) > num_pages or batch * (1 + k) > step.layout.max_num_seqs:
            print(f"  {label}: skipped, its KV does not fit the pool or its rows the step", flush=True)
            continue
        chunks, groups = decode_chunks(batch, ctx, num_pages, seed=batch, drafts=k, greedy=greedy)
        fill_step(step, chunks, PAGE)
        chunk_drafts(step, groups)
        graph = capture(model, step, kv, bucket)
        ms = events_median_ms(graph.replay, reps)
        kv_bytes = batch * ctx * config.num_layers * 2 * config.kv_size * kv.element_size()
        floor = (read_weight_bytes(model, batch) + kv_bytes) / bw * 1e3
        attn_flops = config.num_layers * config.num_heads * config.head_dim * 4 * batch * ctx
        roof = roofline_ms(model, batch, batch, kv_bytes, attn_flops, bw, flops)
        rows.append(dict(model=name, kind="decode", batch=batch, context=ctx, bucket=bucket, drafts=k, step_ms=ms,
                         floor_ms=floor, ratio=ms / floor, roofline_ms=roof, tokens_per_s=batch / ms * 1e3))
        print(f"  {label}: {ms:7.3f} ms  floor {floor:7.3f} ms  x{ms / floor:.2f}  roofline {roof:7.3f} ms  "
              f"x{ms / roof:.2f}", flush=True)
        if power:       # before a profile: replays after CUPTI's are slower
            add_power(rows[-1], graph, label, batch)
        if profile:
            rows[-1]["profile"] = kernel_profile(graph, ms)
        del graph
    for batch in (1, 16, 64, 256) if not (config.num_experts or config.quantization or profile) else ():
        graph = gemms_only_graph(model, batch)
        ms = events_median_ms(graph.replay, reps)
        floor = gemm_weight_bytes(model) / bw * 1e3
        rows.append(dict(model=name, kind="gemms", batch=batch, context=0, step_ms=ms, floor_ms=floor,
                         ratio=ms / floor, tokens_per_s=batch / ms * 1e3))
        print(f"  weight GEMMs only, B={batch}: {ms:.3f} ms  floor {floor:.3f} ms  x{ms / floor:.2f}", flush=True)
        if power:
            add_power(rows[-1], graph, f"weight GEMMs only, B={batch}", batch)
        del graph
    if not profile or "prefill" in profile:
        rows.append(bench_prefill(name, model, buf, kv, bw, flops, reps, "prefill" in profile, power))
    peak = torch.cuda.max_memory_allocated() - before - wbytes - kv.numel() * kv.element_size()
    print(f"  activations: {peak / GIB:.2f} GiB at most (plan: {plan.activation_bytes / GIB:.2f} GiB)", flush=True)
    del kv, model
    torch.cuda.empty_cache()
    return rows


def bench_prefill(name: str, model, buf, kv, bw: float, flops: float, reps: int, profile: bool,
                  power: bool) -> dict:
    """One 2048-token prompt from position 0, against max(FLOP floor, HBM floor) and the per-op roofline; with
    ``power``, its board power replayed back to back."""
    tokens = 2048
    fill_step(buf, [SeqChunk(list(range(tokens)), 0, list(range(tokens // PAGE)))], PAGE)
    graph = capture(model, buf, kv, tokens)
    ms = events_median_ms(graph.replay, reps)
    c = model.config
    attn_flops = c.num_layers * c.num_heads * c.head_dim * 2 * 2 * tokens * (tokens + 1) / 2
    flop_floor = (linear_flops_per_token(c) * tokens + attn_flops) / flops * 1e3
    hbm_floor = read_weight_bytes(model, tokens) / bw * 1e3
    floor = max(flop_floor, hbm_floor)
    kv_bytes = tokens * c.num_layers * 2 * c.kv_size * kv.element_size()  # written once, read back by attention
    roof = roofline_ms(model, tokens, 1, kv_bytes, attn_flops, bw, flops)
    row = dict(model=name, kind="prefill", batch=1, context=tokens, step_ms=ms, floor_ms=floor,
               hbm_floor_ms=hbm_floor, flop_floor_ms=flop_floor, ratio=ms / floor, roofline_ms=roof,
               tokens_per_s=tokens / ms * 1e3)
    print(f"  prefill {tokens} tokens: {ms:.3f} ms = {tokens / ms * 1e3:.0f} tok/s  floor {floor:.3f} ms "
          f"(FLOP {flop_floor:.3f}, HBM {hbm_floor:.3f})  x{ms / floor:.2f}  roofline {roof:.3f} ms  "
          f"x{ms / roof:.2f}", flush=True)
    if power:
        add_power(row, graph, f"prefill {tokens} tokens", tokens)
    if profile:
        row["profile"] = kernel_profile(graph, ms)
    return row


def decode_cell(parser, text: str) -> tuple[int, int, int]:
    """``B,CTX`` or ``B,CTX,BUCKET`` as (batch, context, bucket); the bucket defaults to the batch."""
    try:
        batch, ctx, *rest = (int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"--profile {text}: B,CTX or B,CTX,BUCKET (integers) or prefill")
    bucket = rest[0] if rest else batch
    longest = LAYOUT.max_pages_per_seq * PAGE
    if len(rest) > 1 or not 1 <= batch <= bucket <= LAYOUT.max_num_batched_tokens or not 1 <= ctx <= longest:
        parser.error(f"--profile {text}: needs 1 <= B <= BUCKET <= {LAYOUT.max_num_batched_tokens}, "
                     f"1 <= CTX <= {longest}")
    return batch, ctx, bucket


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "model_bench.json"))
    parser.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(MODELS))
    parser.add_argument("--kv-gib", type=float, default=96.0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", nargs="*", default=[], metavar="B,CTX[,BUCKET]|prefill",
                        help="only these steps, each also broken down per kernel: decode shapes (batch,context), "
                             "e.g. 1,1024, optionally run in a larger graph (batch,context,bucket: the rows "
                             "between batch and bucket are padding, as in a served step), and/or prefill")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="FP8 projections (per-row scales unless --weight-block-size)")
    parser.add_argument("--weight-block-size", type=int, nargs=2, default=None, metavar=("ROWS", "COLS"),
                        help="with --quantization fp8: block scales, e.g. 128 128")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="fp8: the KV pool in e4m3 (rows named <model>-fp8kv; the floor reads K and V at a byte)")
    parser.add_argument("--drafts", type=int, default=0, metavar="K",
                        help="each decode step also with every sequence verifying K speculative drafts (its token "
                             "and the drafts one row each, attention reading them as one chunk, as served)")
    parser.add_argument("--greedy", action="store_true", help="decode rows sample greedily (no top-p: as the "
                        f"served benchmarks), not at temperature {TEMPERATURE} with top-p {TOP_P}")
    parser.add_argument("--power", action="store_true", help="also each step's board power (NVML), replayed "
                        "back to back for 3 s: the kernels' watts without the scheduler or serving")
    args = parser.parse_args()
    profile = {shape if shape == "prefill" else decode_cell(parser, shape) for shape in args.profile}
    torch.manual_seed(0)
    bw, flops = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()  # give the measurement buffers back before the KV pool
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {flops / 1e12:.0f} TFLOP/s",
          flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw,
                  bf16_flop_per_s=flops, rows=[])
    rows = result["rows"]
    if args.weight_block_size and not args.quantization:
        parser.error("--weight-block-size needs --quantization fp8")
    for name in args.models:
        torch.cuda.reset_peak_memory_stats()
        config = requested(MODELS[name], args.quantization)
        if args.weight_block_size:
            config = replace(config, quantization=Fp8Config(tuple(args.weight_block_size)))
        label = name + ("-fp8" if args.quantization else "") + ("-fp8kv" if args.kv_cache_dtype == "fp8" else "")
        rows += bench_model(label + ("-greedy" if args.greedy else ""), config, bw, flops, args.kv_gib, args.reps,
                            profile, args.power, args.drafts, args.kv_cache_dtype, args.greedy)
        with open(args.out, "w") as f:  # after every model: a run cut short keeps what it measured
            json.dump(result, f, indent=2)
    print(f"\n{'model':17} {'kind':7} {'B':>4} {'ctx':>5} {'step ms':>9} {'floor ms':>9} {'ratio':>6} {'roof ms':>9} "
          f"{'/roof':>6} {'tok/s':>9}")
    for r in rows:
        roof = r.get("roofline_ms")
        print(f"{r['model']:17} {r['kind']:7} {r['batch']:4d} {r['context']:5d} {r['step_ms']:9.3f} "
              f"{r['floor_ms']:9.3f} {r['ratio']:6.2f} " + (f"{roof:9.3f} {r['step_ms'] / roof:6.2f} " if roof else
                                                              f"{'-':>9} {'-':>6} ") + f"{r['tokens_per_s']:9.0f}")


if __name__ == "__main__":
    main()
