"""Per-request timelines -> serving metrics, with ``vllm bench serve``'s definitions, names and JSON keys.

For a successful request sent at ``start`` whose streamed chunks arrived at ``t_1 <= ... <= t_k`` and which
generated ``n`` output tokens (the server's ``usage.completion_tokens``):

- TTFT = ``t_1 - start``; E2EL (end-to-end latency) = ``t_k - start``;
- TPOT = ``(E2EL - TTFT) / (n - 1)`` when ``n > 1`` (excluding the first token); a request with ``n <= 1`` has no
  TPOT in the statistics and counts as TPOT 0 for goodput;
- ITL = every gap ``t_{j+1} - t_j``, pooled over all requests (tokens that arrive in one chunk share one gap, as
  in vLLM, so ITL counts chunks and TPOT counts tokens);
- worst gap = a request's longest ITL (one value per request with two chunks or more): the stall a reader of that
  stream saw, which pooled ITL percentiles dilute (not a vLLM metric);
- steady TTFT and steady worst gap = the same over the requests sent once the first request had finished: a closed
  loop sends every stream's first request at once, and that opening burst's queued prefills set the P99 of a few
  hundred requests once per run (not vLLM metrics);
- throughputs divide by the benchmark's wall-clock ``duration``: completed requests, output tokens, input + output
  tokens; goodput = requests meeting every given SLO (``metric <= slo``) per second.

Statistics are mean, median, standard deviation and ``numpy.percentile`` (linear interpolation) in milliseconds;
an empty list gives 0, as in vLLM. Failed requests count in ``failed`` only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
LATENCIES = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"), ("worst_gap", "worst gap", "Worst Inter-token Gap per Request"),
             ("e2el", "E2EL", "End-to-end Latency"))


@dataclass
class RequestOutput:
    """What one request gave back. ``start`` and ``chunk_times`` are ``time.perf_counter()`` seconds: when the
    request was sent, and when each streamed chunk carrying generated tokens arrived (non-decreasing);
    ``output_tokens`` is how many tokens it generated in all. A request succeeded iff ``error is None`` and at least
    one chunk arrived (backends set ``error`` when none did)."""

    prompt_len: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()

    @property
    def worst_gap(self) -> float | None:
        """The longest gap between two chunks; None with fewer than two chunks."""
        return max(self.itl) if len(self.chunk_times) > 1 else None

    @property
    def tpot(self) -> float:
        """0 when there is at most one output token (goodput's convention)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def p_word(p: float) -> str:
    """A percentile as vLLM names it: ``99``, ``99.9``."""
    return str(int(p)) if int(p) == p else str(p)


def percentile_key(metric: str, p: float) -> str:
    """vLLM's JSON key: ``p99_ttft_ms``, ``p99.9_ttft_ms``."""
    return f"p{p_word(p)}_{metric}_ms"


def statistics(metric: str, seconds: list[float], percentiles=PERCENTILES) -> dict:
    """``mean_/median_/std_/p<P>_<metric>_ms`` of ``seconds``, in milliseconds (0 for an empty list)."""
    values = np.asarray(seconds or [0.0]) * 1e3
    stats = {f"mean_{metric}_ms": float(values.mean()), f"median_{metric}_ms": float(np.median(values)),
             f"std_{metric}_ms": float(values.std())}
    stats.update({percentile_key(metric, p): float(np.percentile(values, p)) for p in percentiles})
    return stats


def max_concurrency(outputs: list[RequestOutput]) -> int:
    """Most successful requests in flight at once, each over ``[start, start + latency)`` (ends before starts)."""
    events = sorted([(o.start, 1) for o in outputs if o.success] + [(o.start + o.latency, -1) for o in outputs
                                                                     if o.success])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def steady_state(done: list[RequestOutput]) -> list[RequestOutput]:
    """The successful requests ``done`` that were sent at or after the first of them finished (module docstring)."""
    first_end = min((o.start + o.latency for o in done), default=None)
    return [o for o in done if o.start >= first_end]


def compute(outputs: list[RequestOutput], duration: float, percentiles=PERCENTILES,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
    """The metrics of one benchmark run (module docstring), keyed as ``vllm bench serve`` writes them.

    ``request_goodput`` is ``None`` unless an SLO is given. Per-request lists (``input_lens``, ``output_lens``,
    ``ttfts``, ``latencies`` in seconds, ``errors``) keep the order of ``outputs``; a failed request has output 0 and
    TTFT/latency ``None``.
    """
    if duration <= 0:
        raise ValueError(f"the benchmark duration must be > 0 s (got {duration})")
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    slos = [(ms / 1e3, attr) for ms, attr in ((slo_ttft_ms, "ttft"), (slo_tpot_ms, "tpot")) if ms is not None]
    good = sum(all(getattr(o, attr) <= slo for slo, attr in slos) for o in done)
    result = {"duration": duration, "completed": len(done), "failed": len(outputs) - len(done),
              "total_input_tokens": total_input, "total_output_tokens": total_output,
              "request_throughput": len(done) / duration,
              "request_goodput": good / duration if slos else None,
              "output_throughput": total_output / duration,
              "total_token_throughput": (total_input + total_output) / duration,
              "max_concurrent_requests": max_concurrency(outputs)}
    result.update(statistics("ttft", [o.ttft for o in done], percentiles))
    result.update(statistics("tpot", [o.tpot for o in done if o.output_tokens > 1], percentiles))
    result.update(statistics("itl", [gap for o in done for gap in o.itl], percentiles))
    result.update(statistics("worst_gap", [o.worst_gap for o in done if o.worst_gap is not None], percentiles))
    result.update(statistics("e2el", [o.latency for o in done], percentiles))
    steady = steady_state(done)
    result.update(statistics("steady_ttft", [o.ttft for o in steady], percentiles))
    result.update(statistics("steady_worst_gap", [o.worst_gap for o in steady if o.worst_gap is not None],
                             percentiles))
    result.update({"input_lens": [o.prompt_len for o in outputs],
                   "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
                   "ttfts": [o.ttft if o.success else None for o in outputs],
                   "latencies": [o.latency if o.success else None for o in outputs],
                   "errors": [o.error or "" for o in outputs]})
    return result


def table(result: dict, request_rate: float, max_concurrency: int | None, percentiles=PERCENTILES) -> str:
    """The result block ``vllm bench serve`` prints, for one run."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label, value, fmt="{:<10}"):
        lines.append(f"{label:<40} " + fmt.format(value))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", result["duration"], "{:<10.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "{:<10.2f}")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", result["output_throughput"], "{:<10.2f}")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"], "{:<10.2f}")
    for metric, name, header in LATENCIES:
        lines.append(f"{header:-^50}")
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"], "{:<10.2f}")
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"], "{:<10.2f}")
        for p in percentiles:
            row(f"P{p_word(p)} {name} (ms):", result[percentile_key(metric, p)], "{:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
