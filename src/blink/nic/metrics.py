"""The agent's Prometheus ``Metrics``: its own timings and counters (latencies, its stalls and GC passes), the ring's
control block read at scrape time, and the agent process's and its event loop thread's CPU (``process_*``,
``blink_agent_run_delay_seconds``, and its cores' steal time under a hypervisor). Nothing here is on the per-token
path but ``Metrics.tokens`` and ``poll_gap``; everything else is read when /metrics is scraped."""
from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Two ring polls this far apart while requests are in flight held their tokens back by most of a decode step (5-20 ms
# on 8B models): a stall of the agent, which every stream in flight feels at once.
STALL_S = 5e-3
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, STALL_S, 0.01, 0.02, 0.05, 0.1, 0.5)


class Metrics:
    """Prometheus metrics: the agent's own timings and counters, the ring's control block read at scrape time, and
    the agent process's CPU time and memory (``process_*``: what ``blink bench serve`` meters per 1,000 tokens)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.ttft = Histogram("blink_time_to_first_token_seconds", "From submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("blink_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("blink_e2e_request_latency_seconds", "From submission to the end of the request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # The HTTP server's share besides the ring's: from a streamed request's headers to its first token's chunk
        # written (body, parsing, tokenization and the chunk's write on top of blink_time_to_first_token_seconds).
        self.http_ttft = Histogram("blink_http_time_to_first_chunk_seconds",
                                   "From a streamed request's arrival at the HTTP server to its first token's chunk "
                                   "written", buckets=_LATENCY_BUCKETS, registry=r)
        # Where the agent's own pauses go: the gaps of STALL_S or more between its ring polls while requests are in
        # flight (their time, and the part its event loop's thread was off the CPU), and Python's GC passes. Only
        # the stalls are counted: a histogram of every gap would cost each poll, the agent's hot path, its update.
        self.stalls = Counter("blink_agent_stalls", f"Ring polls {STALL_S * 1e3:g} ms or more after the previous one "
                              "with requests in flight", registry=r)
        self.stall_seconds = Counter("blink_agent_stall_seconds", "Time between the polls of those stalls",
                                     registry=r)
        self.stall_off_cpu_seconds = Counter("blink_agent_stall_off_cpu_seconds", "Of the stalls' time, the part the "
                                             "agent's event loop thread was not running (sleeps, waits for a core)",
                                             registry=r)
        gc_pauses = Histogram("blink_agent_gc_pause_seconds", "Python's cyclic garbage collection passes in the "
                              "agent process", ["generation"], buckets=_GC_BUCKETS, registry=r)
        self._gc_pauses = [gc_pauses.labels(generation=str(g)) for g in range(3)]
        self._gc_started: float | None = None
        self.prompt_tokens = Counter("blink_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.invariant_violations = Counter("blink_invariant_violations", "Idle invariants found broken: pages or "
                                            "slots held, or requests left, with nothing in flight (blink.nic."
                                            "invariants); each is logged once", registry=r)
        self.requests = Counter("blink_requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)

    def watch(self, loop, model_name: str) -> None:
        """Read ``loop`` (an ``AgentLoop``) at every scrape: the ring's words, its queue, its thread; and name what
        vLLM also measures by vLLM's names too, labelled ``model_name`` (``_RingCollector``, ``_HistogramAliases``)."""
        self.registry.register(_RingCollector(loop, model_name))
        self.registry.register(_LoopThreadCollector(loop))
        self.registry.register(_HistogramAliases({"vllm:time_to_first_token_seconds": self.ttft,
                                                  "vllm:inter_token_latency_seconds": self.itl,
                                                  "vllm:e2e_request_latency_seconds": self.e2e}, model_name))

    def tokens(self, req, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if req.last_token_at is None:
            self.ttft.observe(now - req.arrival)
        else:
            # Tokens that arrive in one poll share the gap since the previous poll's tokens.
            for _ in range(n):
                self.itl.observe((now - req.last_token_at) / n)
        req.last_token_at = now

    def poll_gap(self, wall: float, off_cpu: float) -> None:
        """The time between two polls with requests in flight, ``off_cpu`` of it with the loop's thread not running;
        counted if it is a stall."""
        if wall >= STALL_S:
            self.stalls.inc()
            self.stall_seconds.inc(wall)
            self.stall_off_cpu_seconds.inc(max(off_cpu, 0.0))   # the two clocks are read a few ns apart

    def gc_phase(self, phase: str, info: dict) -> None:
        """A ``gc.callbacks`` entry: times each collection from its start to its stop."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_pauses[info["generation"]].observe(time.perf_counter() - self._gc_started)
            self._gc_started = None

    def finished(self, req, reason: str) -> None:
        self.e2e.observe(time.monotonic() - req.arrival)
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def pending(loop, stats: dict) -> int:
    """Requests taken and not yet running, what a load balancer counts as waiting (vLLM's num_requests_waiting):
    those in the ring not yet admitted (``stats``: the agent's ``stats()``) and those queued in ``loop``."""
    return stats["waiting"] + len(loop.waiting)


class _RingCollector:
    """Gauges and counters the GPU side keeps in the ring's control block, plus the agent's wait queue; and, from the
    same read, those vLLM exports too under vLLM's names and ``model_name`` label, which its Grafana dashboards and
    the Kubernetes Gateway API inference extension's endpoint picker read."""

    def __init__(self, loop, model_name: str):
        self.loop, self.model_name = loop, model_name

    def collect(self):
        s = self.loop.agent.stats()
        gauges = {"blink_requests_running": ("Requests the engine is running", s["running"]),
                  "blink_requests_waiting": ("Requests in the ring not yet admitted", s["waiting"]),
                  "blink_requests_queued": ("Requests waiting in the agent for a free ring slot",
                                            len(self.loop.waiting)),
                  "blink_kv_cache_usage_ratio": ("Fraction of KV-cache pages in use",
                                                 1 - s["kv_pages_free"] / s["kv_pages_total"]
                                                 if s["kv_pages_total"] else 0.0),
                  "blink_prefix_cache_pages": ("KV pages in the prefix cache, in use or evictable", s["cached_pages"]),
                  "blink_prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache per prompt token looked up",
                                                  s["prefix_hit_tokens"] / s["prefix_query_tokens"]
                                                  if s["prefix_query_tokens"] else 0.0)}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {"blink_generation_tokens": ("Tokens generated by the engine", s["tokens"]),
                    "blink_preemptions": ("Recompute preemptions", s["preempted"]),
                    "blink_engine_steps": ("Model steps launched", s["steps"]),
                    "blink_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                                   s["prefix_query_tokens"]),
                    "blink_prefix_cache_hits": ("Prompt tokens found in the prefix cache", s["prefix_hit_tokens"]),
                    "blink_prefix_cache_evictions": ("Cached KV pages evicted for reuse", s["prefix_evictions"]),
                    "blink_prefill_tokens": ("Prompt tokens the model computed (cache hits excluded)",
                                             s["prefill_tokens"]),
                    "blink_spec_decode_num_drafts": ("Sequence steps that verified speculative drafts",
                                                     s["spec_drafts"]),
                    "blink_spec_decode_num_draft_tokens": ("Speculative draft tokens verified",
                                                           s["spec_draft_tokens"]),
                    "blink_spec_decode_num_accepted_tokens": ("Speculative draft tokens accepted",
                                                              s["spec_accepted_tokens"])}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from self._vllm(s, gauges, counters)

    def _vllm(self, s, gauges, counters):
        waiting = pending(self.loop, s)
        for name, doc, value in [
                ("vllm:num_requests_running", "Requests the engine is running", gauges["blink_requests_running"][1]),
                ("vllm:num_requests_waiting", "Requests not yet running: in the ring not yet admitted, or waiting in "
                                              "the agent for a free ring slot", waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1: all)",
                 gauges["blink_kv_cache_usage_ratio"][1])]:
            yield self._labelled(GaugeMetricFamily(name, doc, labels=["model_name"]), value)
        for name, blink_name in [("vllm:prefix_cache_queries", "blink_prefix_cache_queries"),
                                 ("vllm:prefix_cache_hits", "blink_prefix_cache_hits"),
                                 ("vllm:spec_decode_num_drafts", "blink_spec_decode_num_drafts"),
                                 ("vllm:spec_decode_num_draft_tokens", "blink_spec_decode_num_draft_tokens"),
                                 ("vllm:spec_decode_num_accepted_tokens", "blink_spec_decode_num_accepted_tokens")]:
            doc, value = counters[blink_name]
            yield self._labelled(CounterMetricFamily(name, doc, labels=["model_name"]), value)

    def _labelled(self, family, value):
        family.add_metric([self.model_name], value)
        return family


class _HistogramAliases:
    """The agent's latency histograms again under vLLM's names (``vllm name -> Histogram``), labelled
    ``model_name``: copied at scrape time, so a token costs one observation, not two."""

    def __init__(self, histograms: dict, model_name: str):
        self.histograms, self.model_name = histograms, model_name

    def collect(self):
        for name, histogram in self.histograms.items():
            for family in histogram.collect():
                alias = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    alias.add_sample(name + sample.name[len(family.name):],
                                     {**sample.labels, "model_name": self.model_name}, sample.value, sample.timestamp)
                yield alias


class _LoopThreadCollector:
    """How long the event loop's thread has waited for a core: runnable, not running (Linux's schedstat for the
    thread, its second field; absent where the kernel keeps none). The stalls' off-CPU time also holds the loop's own
    sleeps; this is only the waits a busy core imposed."""

    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        try:
            with open(f"/proc/{os.getpid()}/task/{self.loop.thread_id}/schedstat") as f:
                waited_ns = int(f.read().split()[1])
            cores = os.sched_getaffinity(self.loop.thread_id)
        except (OSError, ValueError, IndexError):      # not Linux, no schedstat, or the loop has not started
            return
        yield CounterMetricFamily("blink_agent_run_delay_seconds", "Time the agent's event loop thread was runnable "
                                  "but waiting for a core", value=waited_ns / 1e9)
        steal_s = _steal_seconds(cores)
        if steal_s is not None:
            yield CounterMetricFamily("blink_agent_cores_steal_seconds", "Time a hypervisor ran something else on "
                                      "the cores the agent's event loop thread may use (/proc/stat's steal, summed)",
                                      value=steal_s)


def _steal_seconds(cores) -> float | None:
    """The steal time of ``cores`` (the 8th value of their ``cpuN`` lines in /proc/stat, in clock ticks): time their
    virtual CPUs were runnable but the host ran something else (a guest kernel without steal accounting counts it
    as the running thread's CPU time). None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return None
    ticks = sum(int(row[8]) for row in lines if int(row[0][3:]) in cores and len(row) > 8)
    return ticks / os.sysconf("SC_CLK_TCK")
