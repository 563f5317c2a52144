"""Result tables for documents: ``blink bench report --markdown`` prints one Markdown row per run of the result JSONs
of ``blink bench serve``, the columns the serving tables of docs/benchmarks/ use, so that a table there is the command's
output and not a copy made by hand. A value a run does not have (no energy meter, a server without /metrics) is n/a.
"""
from __future__ import annotations

# (heading, how a run's value is written); each writer takes the run record and returns the cell's text.
COLUMNS = (
    ("server", lambda run: run["label"]),
    ("condition", lambda run: "isolated" if not run["interference"] else f"{run['interference']} hogs"),
    ("req/s", lambda run: str(run["request_rate"])),
    ("streams", lambda run: "-" if run.get("max_concurrency") is None else str(run["max_concurrency"])),
    ("out tok/s", lambda run: number(run["output_throughput"], ",.1f")),
    ("P50 / P99 TTFT ms", lambda run: _pair(run, "ttft", ",.1f")),
    ("P50 / P99 TPOT ms", lambda run: _pair(run, "tpot", ",.2f")),
    ("P50 / P99 ITL ms", lambda run: _pair(run, "itl", ",.2f")),
    ("P99 worst gap ms", lambda run: number(run.get("p99_worst_gap_ms"), ",.1f")),
    ("J / out tok", lambda run: number((run.get("energy") or {}).get("joules_per_output_token"), ".4f")),
    ("mean W", lambda run: number((run.get("energy") or {}).get("mean_power_w"), ".0f")),
    ("server CPU ms / 1k tok", lambda run: number(run.get("server_cpu_ms_per_1k_tokens"), ",.1f")),
    ("tokens / step", lambda run: number(run.get("server_tokens_per_step"), ".1f")),
)


def markdown(runs: list[dict]) -> str:
    """A Markdown table of ``runs`` (the ``runs`` records of result JSONs), one row each, in order."""
    lines = ["| " + " | ".join(heading for heading, _ in COLUMNS) + " |",
             "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(cell(run) for _, cell in COLUMNS) + " |" for run in runs]
    return "\n".join(lines)


def number(value, fmt: str) -> str:
    """A metric as text; n/a where a run does not have it (a server without /metrics, no energy meter, older JSON)."""
    return "n/a" if value is None else format(value, fmt)


def _pair(run: dict, metric: str, fmt: str) -> str:
    return f"{number(run.get(f'p50_{metric}_ms'), fmt)} / {number(run.get(f'p99_{metric}_ms'), fmt)}"
