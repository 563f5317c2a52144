"""``blink bench serve``: online-serving benchmark; ``blink bench report``: several results side by side, and plots.

``serve`` sends the dataset's requests at the arrival times of each rate of the sweep (``traffic``), through an
OpenAI-compatible server (``--backend openai``, ``client``) or transformers' continuous batching in this process
(``--backend hf``, ``peer``), and computes ``vllm bench serve``'s metrics for each rate (``metrics``). With
``--interference N`` the whole sweep runs twice: isolated, then colocated with N hog processes (``interference``),
placed by ``--reserve-cpus`` / ``--client-cpus`` / ``--client-priority`` (``placement``: the three layouts). GPU
energy is metered per run (``energy``), and so is the server's CPU time per 1,000 output tokens (its /metrics
``process_cpu_seconds_total``, or with ``--server-pid`` its processes' from /proc; for the peer, this process's).
Before the sweep one request goes through alone (a failure stops the benchmark there, naming the error), then, before
each condition's sweep (after the hogs have started), ``--num-warmups`` requests at once (up to ``--max-concurrency``
in flight), not measured, so that no sweep measures a cold server or opens connections the other reused. Writes one
JSON (``--result-json``: the options, then a record per run, with the server's own counters over the run where it
has them: prefill tokens, prefix-cache hits) and PNGs (``--plot-dir``); exits 1 if any request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

from blink.bench.interference import HOG_KINDS, interference

HOG_SETTLE_S = 2.0       # hogs import numpy and fill their buffers before the colocated sweep starts


def add_parsers(subparsers) -> None:
    """``serve`` and ``report`` under ``blink bench``."""
    from blink.bench.datasets import DEFAULT_PREFIX_LEN

    p = subparsers.add_parser("serve", help="online-serving benchmark (vllm bench serve's metrics)",
                              description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("openai", "hf"), default="openai",
                   help="openai: an OpenAI-compatible server at --base-url; hf: transformers' continuous batching "
                        "in this process on --model")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root (without /v1)")
    p.add_argument("--model", default=None, help="openai: the model name to request (default: the server's first); "
                   "hf: the model directory (HF layout)")
    p.add_argument("--label", default=None, help="the name of this backend in results and plots (default: "
                   "--backend)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="hf: dummy = random weights from config.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="hf: default the GPU if there is one")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="hf: default the checkpoint's on a GPU, float32 on the CPU")
    p.add_argument("--dataset", choices=("synthetic", "sharegpt", "prefix"), default="synthetic",
                   help="prefix: one system prompt before every request (the prefix cache's workload)")
    p.add_argument("--dataset-path", default=None, help="sharegpt: a ShareGPT_V3 JSON file")
    p.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN, help="prefix: tokens of the shared system "
                   "prompt")
    p.add_argument("--turns", type=int, default=1,
                   help="prefix: turns per conversation, each resending the ones before it (1: single requests)")
    p.add_argument("--tokenizer", default=None, help="model directory whose tokenizer.json encodes ShareGPT text "
                   "and bounds synthetic token ids (default: --model if it has one, else the embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=None,
                   help="fix every request's output length (vllm bench serve: --random-output-len)")
    p.add_argument("--input-len", type=int, default=None,
                   help="synthetic: fix every prompt's length in tokens (vllm bench serve: --random-input-len)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s; inf sends every request at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is a Poisson process, < 1 burstier, > 1 more regular")
    p.add_argument("--sweep", type=_rates, default=None, help="rates to run in turn, e.g. 1,2,4,inf "
                   "(instead of --request-rate)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent at once before each condition's sweep "
                   "and not measured (the dataset's first ones, repeated if it has fewer)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly each request's output length (default: on when --output-len fixes it)")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival times")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="openai: every request's answer follows the "
                   "JSON schema in FILE (response_format json_schema; needs --no-ignore-eos)")
    p.add_argument("--server-pid", type=int, default=None, metavar="PID",
                   help="openai: meter the server's CPU time as process PID's and its descendants' (from /proc, on "
                        "this host) instead of its /metrics process_cpu_seconds_total, which counts one process "
                        "(blink: its agent processes; vLLM: its API server, not its engine core)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO (vLLM: --goodput ttft:MS)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO (vLLM: --goodput tpot:MS)")
    p.add_argument("--interference", type=int, default=0, metavar="N",
                   help="also run the sweep with N CPU- and memory-heavy processes (e.g. 4 x the cores)")
    p.add_argument("--hog-kind", choices=tuple(HOG_KINDS), default="mixed",
                   help="what the --interference processes do: half copy memory and half compress (mixed), or all "
                        "copy (memory bandwidth) or all compress (CPU time with little memory traffic)")
    p.add_argument("--client-priority", choices=("normal", "high", "deadline"), default="normal",
                   help="CPU priority of this benchmark process (high = nice -10, deadline = SCHED_DEADLINE as "
                        "blink serve --agent-priority deadline; both need CAP_SYS_NICE; the hogs stay at nice 0), "
                        "so that under --interference the server and not the load generator is what "
                        "competes with the hogs (a client on another host); with --backend hf the model runs in this "
                        "process and gets it too")
    p.add_argument("--reserve-cpus", type=_cores, default=None, metavar="LIST",
                   help="cores the hogs never touch, e.g. 14,15 (a DPU or reserved-cpuset stand-in): start the server "
                        "there (taskset -c LIST blink serve ...); the client runs there too unless --client-cpus")
    p.add_argument("--client-cpus", type=_cores, default=None, metavar="LIST",
                   help="pin this benchmark process (the client) to these cores")
    p.add_argument("--result-json", default=None, help="write the results here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.set_defaults(run=serve)
    r = subparsers.add_parser("report", help="summary and plots of result JSONs of blink bench serve")
    r.add_argument("results", nargs="+", help="result JSON files")
    r.add_argument("--plot-dir", default=None, help="write PNG plots of every run here")
    r.add_argument("--markdown", action="store_true", help="print the runs as a Markdown table instead of the summary "
                   "(the columns of the serving tables in docs/benchmarks/)")
    r.set_defaults(run=report)


def _cores(text: str) -> list[int]:
    from blink.host.cores import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> list[float]:
    try:
        rates = sorted(float(r) for r in text.split(","))
    except ValueError:
        rates = []
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError(f"request rates > 0 separated by commas, e.g. 1,2,4,inf (got {text!r})")
    return rates


def rate_json(rate: float):
    """A request rate as vLLM writes it in JSON: the number, or ``"inf"`` (JSON has no infinity)."""
    return "inf" if rate == float("inf") else rate


def load_requests(args) -> list:
    """The dataset's requests (``datasets``), with the tokenizer of ``tokenizer_dir(args)``; checks the counts."""
    from blink.bench import datasets
    from blink.nic.text import Tokenizer

    for option, value in (("--num-prompts", args.num_prompts), ("--output-len", args.output_len),
                          ("--input-len", args.input_len), ("--max-concurrency", args.max_concurrency)):
        if value is not None and value < 1:
            raise ValueError(f"{option} must be >= 1 (got {value})")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0 (got {args.num_warmups})")
    if args.input_len is not None and args.dataset != "synthetic":
        raise ValueError(f"--input-len fixes the synthetic dataset's prompts; --dataset {args.dataset} has its own")
    tokenizer = Tokenizer(tokenizer_dir(args))
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path (a ShareGPT_V3 JSON file)")
        return datasets.sharegpt(args.dataset_path, tokenizer.encode, args.num_prompts, args.seed, args.output_len)
    if args.dataset == "prefix":
        return datasets.shared_prefix(args.num_prompts, tokenizer.vocab_size, args.seed, args.output_len,
                                      args.prefix_len, args.turns)
    return datasets.synthetic(args.num_prompts, tokenizer.vocab_size, args.seed, args.output_len, args.input_len)


def tokenizer_dir(args) -> str:
    if args.tokenizer is not None:
        return args.tokenizer
    if args.model is not None and (Path(args.model) / "tokenizer.json").is_file():
        return args.model
    from blink.models import default_model_path
    return str(default_model_path())


def make_backend(args, requests):
    if args.backend == "hf":
        from blink.bench.peer import HFPeer

        if args.model is None:
            raise ValueError("--backend hf needs --model (a model directory)")
        return HFPeer(args.model, requests, load_format=args.load_format, device=args.device, dtype=args.dtype,
                      ignore_eos=args.ignore_eos, seed=args.seed)
    from blink.bench.client import OpenAIClient

    schema = None if args.json_schema is None else json.loads(Path(args.json_schema).read_text())
    response_format = None if schema is None else {"type": "json_schema",
                                                   "json_schema": {"name": "answer", "schema": schema}}
    return OpenAIClient(args.base_url, args.model, args.ignore_eos, response_format, args.server_pid)


async def benchmark(backend, requests: list, args, save, hog_cpus) -> list[dict]:
    """Every (condition, rate) run of ``args`` through ``backend``, the hogs on ``hog_cpus``; calls ``save(runs so
    far, backend info)`` after each run, so a benchmark cut short keeps what it measured. Returns the run records."""
    from blink.bench import metrics
    from blink.bench.energy import EnergyMeter
    from blink.bench.process_cpu import cpu_per_1k_tokens
    from blink.bench.client import (CPU_COUNTER, SERVER_HTTP_TTFT, SERVER_TTFT, histogram_mean_ms,
                                    tokens_per_step)
    from blink.bench.traffic import arrival_times, send_all

    rates = args.sweep or [args.request_rate]
    conditions = [("isolated", 0)] + ([("colocated", args.interference)] if args.interference else [])
    runs = []
    async with backend:
        first = await backend.send(requests[0])
        if first.error is not None:
            raise ValueError(f"the first request failed: {first.error}")
        for condition, hogs in conditions:
            with interference(hogs, HOG_KINDS[args.hog_kind], cpus=hog_cpus):
                if hogs:
                    await asyncio.sleep(HOG_SETTLE_S)
                # Per condition, so that each sweep starts from the same state: caches warm and connections open.
                # Warmed once, the colocated sweep's first burst opened a connection per request (the client drops
                # idle ones after 2 s) while the isolated sweep's reused the warm-up's.
                await warm_up(backend, requests, args)
                for rate in rates:
                    print(f"\n{args.label or args.backend} {condition}: {len(requests)} requests at "
                          f"{rate} req/s (burstiness {args.burstiness})", flush=True)
                    arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
                    before, client_start = await backend.server_counters(), time.process_time()
                    with EnergyMeter() as meter:
                        outputs, duration = await send_all(backend.send, requests, arrivals, args.max_concurrency)
                    after = await backend.server_counters()
                    server = {k: after[k] - before[k] for k in after if k in before} if before and after else None
                    cpu = cpu_per_1k_tokens(server and server.get(CPU_COUNTER), time.process_time() - client_start,
                                            sum(o.output_tokens for o in outputs if o.success))
                    result = metrics.compute(outputs, duration, slo_ttft_ms=args.slo_ttft_ms,
                                             slo_tpot_ms=args.slo_tpot_ms)
                    print(metrics.table(result, rate, args.max_concurrency), flush=True)
                    runs.append({"label": args.label or args.backend, "condition": condition, "interference": hogs,
                                 "request_rate": rate_json(rate),
                                 "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                                 "energy": meter.result(result["total_output_tokens"]), "server": server, **cpu,
                                 "server_mean_ttft_ms": histogram_mean_ms(server, SERVER_TTFT),
                                 "server_http_mean_ttft_ms": histogram_mean_ms(server, SERVER_HTTP_TTFT),
                                 "server_tokens_per_step": tokens_per_step(server), **result})
                    save(runs, backend.info())
    return runs


async def warm_up(backend, requests: list, args) -> None:
    """``args.num_warmups`` of the dataset's requests at once (``--max-concurrency`` still applies), unmeasured; a
    failure stops the benchmark, naming the error."""
    from blink.bench.traffic import send_all

    warm = [requests[i % len(requests)] for i in range(args.num_warmups)]
    outputs, _ = await send_all(backend.send, warm, [0.0] * len(warm), args.max_concurrency)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise ValueError(f"{len(failed)} of {len(warm)} warm-up requests failed; the first: {failed[0]}")


def serve(args) -> int:
    from blink.bench.placement import layout, pin_client
    from blink.host.priority import set_priority

    args.ignore_eos = ignore_eos(args.ignore_eos, args.output_len)
    client_priority = set_priority(args.client_priority, "--client-priority")
    placed = layout(args.reserve_cpus, args.client_cpus)
    pin_client(placed)
    if args.interference:
        print(placed.describe(), flush=True)
    requests = load_requests(args)
    options = {k: v for k, v in vars(args).items() if k != "run"}
    options.update(request_rate=rate_json(args.request_rate), sweep=args.sweep and [rate_json(r) for r in args.sweep])
    header = {"date": datetime.now().isoformat(timespec="seconds"), "host": host(), **options,
              "client_priority_achieved": client_priority, "layout": placed.as_json()}

    def save(runs, info):
        if args.result_json:
            Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.result_json, "w") as f:
                json.dump({**header, "backend_info": info, "runs": runs}, f, indent=1, allow_nan=False)

    runs = asyncio.run(benchmark(make_backend(args, requests), requests, args, save, placed.hog_cpus))
    summarize(runs, args.plot_dir)
    failed = sum(r["failed"] for r in runs)
    if failed:
        first = next(e for r in runs for e in r["errors"] if e)
        print(f"{failed} requests failed; the first: {first}", file=sys.stderr)
    return 1 if failed else 0


def ignore_eos(given: bool | None, output_len: int | None) -> bool:
    """``--ignore-eos`` as given, or on when ``--output-len`` fixes the length (EOS would cut it short)."""
    return output_len is not None if given is None else given


def host() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}


def summary(runs: list[dict]) -> str:
    """One line per run, then colocated / isolated ratios per label and rate, then each series' saturation."""
    from blink.bench.client import server_notes
    from blink.bench.plots import colocation_pairs, series
    from blink.bench.tables import number

    width = max([10] + [len(run["label"]) for run in runs])
    lines = [(f"{'label':<{width}} {'condition':<10} {'rate':>6} {'req/s':>8} {'out tok/s':>10} "
              f"{'P50/P99 TTFT ms':>16} {'P99 TPOT ms':>12} {'P99 worst gap ms':>17} {'server CPU ms/1k tok':>21} "
              f"{'J/out tok':>10}")]
    for run in runs:
        lines.append(f"{run['label']:<{width}} {run['condition']:<10} {run['request_rate']:>6} "
                     f"{run['request_throughput']:>8.2f} {run['output_throughput']:>10.1f} "
                     f"{run['p50_ttft_ms']:>7.2f} / {run['p99_ttft_ms']:<6.2f} {run['p99_tpot_ms']:>12.2f} "
                     f"{number(run.get('p99_worst_gap_ms'), '.2f'):>17} "
                     f"{number(run.get('server_cpu_ms_per_1k_tokens'), '.1f'):>21} "
                     f"{number(run['energy']['joules_per_output_token'], '.4f'):>10}")
    for run in runs:
        pauses = server_notes(run.get("server"))
        if pauses:
            lines.append(f"{run['label']} {run['condition']} @ {run['request_rate']}: {pauses}")
    for iso, col in colocation_pairs(runs):
        ratios = ", ".join(f"{name} {_ratio(col.get(key), iso.get(key))}" for name, key in (
            ("P50 TTFT", "p50_ttft_ms"), ("P99 TTFT", "p99_ttft_ms"), ("P99 TPOT", "p99_tpot_ms"),
            ("P99 worst gap", "p99_worst_gap_ms"), ("steady P99 TTFT", "p99_steady_ttft_ms"),
            ("steady P99 worst gap", "p99_steady_worst_gap_ms"), ("server CPU/token", "server_cpu_ms_per_1k_tokens"),
            ("mean TTFT", "mean_ttft_ms"), ("HTTP server's mean TTFT", "server_http_mean_ttft_ms"),
            ("ring's mean TTFT", "server_mean_ttft_ms"),
            ("tokens per step", "server_tokens_per_step")))
        lines.append(f"{iso['label']} @ {iso['request_rate']}: colocated/isolated output throughput "
                     f"{_ratio(col['output_throughput'], iso['output_throughput'])}, {ratios} "
                     f"({col['interference']} hogs)")
    for name, rs in series(runs).items():
        lines.append(f"saturation {name}: {max(r['output_throughput'] for r in rs):.1f} output tokens/s")
    return "\n".join(lines)


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def report(args) -> int:
    runs = []
    for path in args.results:
        with open(path) as f:
            runs += json.load(f)["runs"]
    summarize(runs, args.plot_dir, args.markdown)
    return 0


def summarize(runs: list[dict], plot_dir: str | None, markdown: bool = False) -> None:
    """Print ``summary(runs)`` (``markdown``: the Markdown table of ``tables`` instead); write the plots into
    ``plot_dir`` if given."""
    from blink.bench import tables

    print(tables.markdown(runs) if markdown else summary(runs))
    if plot_dir:
        from blink.bench.plots import write_plots
        for path in write_plots(runs, plot_dir):
            print(f"wrote {path}")
