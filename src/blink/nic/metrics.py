"""The agent's Prometheus ``Metrics``: its own timings and counters (latencies, its stalls and GC passes), the ring's
control block read at scrape time (``blink.nic.engine_metrics``), and the agent process's and its event loop
thread's CPU (``process_*``, ``blink_agent_run_delay_seconds``, and its cores' steal time under a hypervisor). Nothing
here is on the per-token path but ``Metrics.tokens`` (a ``Batched`` count) and ``poll_gap``.

Values that live in the process (its wait queue, its requests in flight, its loop thread's waits for a core) are
published into gauges and counters (``publish``) before each scrape. Where several agent processes serve one ring
(``blink serve --agent-processes``, ``shared_metrics``) each keeps its metrics in files under
``$PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, chosen as it is imported), publishes them every
``AgentLoop`` sample too (0.1 s: another process's are that old at most), and a scrape, whichever process it
reaches, reports them summed over the processes (``MultiProcessCollector``; a gauge as its ``multiprocess_mode``
says, of the live processes), and the ring's words, which all of them read alike, once.
"""
from __future__ import annotations

import bisect
import os
import shutil
import tempfile
import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from blink.nic.engine_metrics import engine_families

# Two ring polls this far apart while requests are in flight held their tokens back by most of a decode step (5-20 ms
# on 8B models): a stall of the agent, which every stream in flight feels at once.
STALL_S = 5e-3
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, STALL_S, 0.01, 0.02, 0.05, 0.1, 0.5)
SHARED_DIR = "PROMETHEUS_MULTIPROC_DIR"     # prometheus_client's: where processes keep the metrics they share


@contextmanager
def shared_metrics():
    """The metrics of the agent processes started inside this block summed over them (``SHARED_DIR``, a fresh
    directory, removed after, and those that killed servers of this user left removed first); yields
    ``exited(pid)``, to call once an agent process has exited (its live gauges go with it; its counters stay in the
    sums)."""
    _sweep_shared_dirs()
    path, before = tempfile.mkdtemp(prefix=f"blink-metrics-{os.getpid()}-"), os.environ.get(SHARED_DIR)
    os.environ[SHARED_DIR] = path
    try:
        yield lambda pid: mark_process_dead(pid, path)
    finally:
        if before is None:
            del os.environ[SHARED_DIR]
        else:
            os.environ[SHARED_DIR] = before
        shutil.rmtree(path, ignore_errors=True)


def _sweep_shared_dirs() -> None:
    """Remove the metrics directories of servers of this user that are gone (``blink-metrics-PID-...``, PID not
    running): a server killed with SIGKILL leaves its own behind."""
    for entry in os.scandir(tempfile.gettempdir()):
        pid = entry.name.removeprefix("blink-metrics-").split("-")[0]
        if entry.name.startswith("blink-metrics-") and pid.isdigit() and entry.is_dir(follow_symlinks=False) \
                and entry.stat(follow_symlinks=False).st_uid == os.geteuid() and not _running(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                # another user's process
    return True


class Metrics:
    """Prometheus metrics: the agent's own timings and counters, the ring's control block read at scrape time, and
    the agent process's CPU time and memory (``process_*``: what ``blink bench serve`` meters per 1,000 tokens; where
    processes share their metrics, only ``process_cpu_seconds_total``, summed)."""

    def __init__(self):
        self.shared = os.environ.get(SHARED_DIR)     # the directory several agent processes keep their metrics in
        self._own = r = CollectorRegistry()         # this process's metrics (in files under that directory)
        self._publishers = []
        self.registry = CollectorRegistry()         # what /metrics shows
        if self.shared:
            cpu = Counter("process_cpu_seconds", "Total user and system CPU time of the agent processes in seconds",
                          registry=r)
            self.publishing(_growth(cpu, lambda: sum(os.times()[:2])))
        else:
            ProcessCollector(registry=self.registry)
        self.ttft = Histogram("blink_time_to_first_token_seconds", "From submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("blink_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Batched(self.itl)       # one observation a token: counted here, published in bulk
        self.publishing(self._itl.publish)
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
        # Counted without prometheus_client's lock and published by the event loop: a collection can start while
        # its thread holds that lock (inside prometheus_client, which allocates), and the callback taking it again
        # hung an agent process for good. A pass another thread starts may race a publish and lose its count.
        self._gc_pauses = [Batched(gc_pauses.labels(generation=str(g))) for g in range(3)]
        for pauses in self._gc_pauses:
            self.publishing(pauses.publish)
        self._gc_started: float | None = None
        self.prompt_tokens = Counter("blink_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.invariant_violations = Counter("blink_invariant_violations", "Idle invariants found broken: pages or "
                                            "slots held, or requests left, with nothing in flight (blink.nic."
                                            "invariants); each is logged once", registry=r)
        self.requests = Counter("blink_requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.queued = self.gauge("blink_requests_queued", "Requests waiting in the agent for a free ring slot")

    def gauge(self, name: str, doc: str, mode: str = "livesum") -> Gauge:
        """A gauge of this process's, which ``publish`` sets; ``mode``: how the processes' values make one where
        several share their metrics (prometheus_client's ``multiprocess_mode``: livesum, livemax)."""
        return Gauge(name, doc, registry=self._own, multiprocess_mode=mode)

    def publishing(self, publish) -> None:
        """``publish()`` sets gauges and counters of this process's from what it keeps (see ``publish``)."""
        self._publishers.append(publish)

    def publish(self) -> None:
        """Bring the values this process keeps into its metrics: before a scrape, and at each ``tick``."""
        for publish in self._publishers:
            publish()

    def tick(self) -> None:
        """The agent loop's sample (every 0.1 s): where processes share their metrics, publish (a scrape that
        another process answers reads them from the files)."""
        if self.shared:
            self.publish()

    def watch(self, loop, model_name: str) -> None:
        """Read ``loop`` (an ``AgentLoop``): its queue and its thread, published; the ring's words at every scrape;
        and name what vLLM also measures by vLLM's names too, labelled ``model_name`` (``_Exposition``)."""
        self.publishing(lambda: self.queued.set(len(loop.waiting)))
        self.publishing(_LoopThread(loop, self._own).publish)
        self.registry.register(_Exposition(self, loop, model_name))

    def own_families(self):
        """This process's metrics; where processes share them, every agent process's, summed."""
        return MultiProcessCollector(None, self.shared).collect() if self.shared else self._own.collect()

    def tokens(self, req, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if req.last_token_at is None:
            self.ttft.observe(now - req.arrival)
        else:
            # Tokens that arrive in one poll share the gap since the previous poll's tokens.
            self._itl.observe((now - req.last_token_at) / n, n)
        req.last_token_at = now

    def poll_gap(self, wall: float, off_cpu: float) -> None:
        """The time between two polls with requests in flight, ``off_cpu`` of it with the loop's thread not running;
        counted if it is a stall."""
        if wall >= STALL_S:
            self.stalls.inc()
            self.stall_seconds.inc(wall)
            self.stall_off_cpu_seconds.inc(max(off_cpu, 0.0))   # the two clocks are read a few ns apart

    def gc_phase(self, phase: str, info: dict) -> None:
        """A ``gc.callbacks`` entry: times each collection from its start to its stop. Takes no lock (the
        collection may run inside one)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_pauses[info["generation"]].observe(time.perf_counter() - self._gc_started)
            self._gc_started = None

    def finished(self, req, reason: str) -> None:
        self.e2e.observe(time.monotonic() - req.arrival)
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        self.publish()
        return generate_latest(self.registry)


class Batched:
    """Observations of an unlabelled ``Histogram`` kept as plain counts per bucket until ``publish`` adds them to it,
    as its ``observe`` would have: on the per-token path an observation costs a bisect and two additions (~0.15 us)
    where ``observe`` takes a lock for each value it updates (0.9 us; 2 us where agent processes share their
    metrics, each value a file-backed map). ``publish`` increments the histogram's own values (prometheus_client's
    ``_buckets``, per bucket and not cumulative, and ``_sum``; ``tests/nic/test_metrics.py`` holds them to
    ``observe``). Only the event loop's thread observes and publishes."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram
        self.bounds = histogram._upper_bounds       # ascending, the last +Inf: an amount <= a bound is in its bucket
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, amount: float, n: int = 1) -> None:
        """``n`` observations of ``amount``."""
        self.counts[bisect.bisect_left(self.bounds, amount)] += n
        self.sum += amount * n

    def publish(self) -> None:
        # Taken before the increments: an observation made while they run (a GC pass inside one) counts next time.
        counts, self.counts = self.counts, [0] * len(self.bounds)
        total, self.sum = self.sum, 0.0
        for value, count in zip(self.histogram._buckets, counts, strict=True):
            if count:
                value.inc(count)
        if any(counts):
            self.histogram._sum.inc(total)


# The agent's latency histograms again under vLLM's names, labelled with the served model's name.
VLLM_ALIASES = {"blink_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
                "blink_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
                "blink_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds"}


class _Exposition:
    """What /metrics shows of the agent: its own metrics (every agent process's, summed, where they share them),
    the latency histograms again under vLLM's names (``VLLM_ALIASES``, copied at scrape time: a token costs one
    observation, not two), and the engine's words in the ring (``engine_families``), once."""

    def __init__(self, metrics: Metrics, loop, model_name: str):
        self.metrics, self.loop, self.model_name = metrics, loop, model_name

    def collect(self):
        queued = 0.0
        for family in self.metrics.own_families():
            yield family
            if family.name == "blink_requests_queued":
                queued = sum(sample.value for sample in family.samples)
            alias = VLLM_ALIASES.get(family.name)
            if alias is not None:
                yield self._alias(alias, family)
        agent = self.loop.agent
        yield from engine_families(agent.stats(), queued, agent.geometry.n_slots, self.model_name)

    def _alias(self, name: str, family: Metric) -> Metric:
        alias = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            alias.add_sample(name + sample.name[len(family.name):], {**sample.labels, "model_name": self.model_name},
                             sample.value, sample.timestamp)
        return alias


def _growth(counter: Counter, read):
    """A publisher that adds to ``counter`` what ``read()`` (a total that only grows, or None while unknown) grew by
    since the last call: the counter then equals the total, and sums over processes where they share metrics."""
    last = [0.0]

    def publish() -> None:
        now = read()
        if now is not None:
            counter.inc(max(now - last[0], 0.0))
            last[0] = now
    return publish


class _LoopThread:
    """How long the event loop's thread has waited for a core: runnable, not running (Linux's schedstat for the
    thread, its second field; 0 where the kernel keeps none). The stalls' off-CPU time also holds the loop's own
    sleeps; this is only the waits a busy core imposed. And the steal time of the cores it may use, each counted
    while it may use it (``_steal_seconds``)."""

    def __init__(self, loop, registry: CollectorRegistry):
        self.loop = loop
        self.run_delay = _growth(Counter("blink_agent_run_delay_seconds", "Time the agent's event loop thread was "
                                         "runnable but waiting for a core", registry=registry), self._waited_s)
        self.steal = Counter("blink_agent_cores_steal_seconds", "Time a hypervisor ran something else on the cores "
                             "the agent's event loop thread may use (/proc/stat's steal, summed)", registry=registry)
        self._stolen: dict[int, float] = {}         # core -> its steal seconds at the last publish

    def publish(self) -> None:
        self.run_delay()
        try:
            cores = os.sched_getaffinity(self.loop.thread_id)
        except (OSError, TypeError):        # the loop has not started
            return
        stolen = _steal_seconds()
        self.steal.inc(sum(max(stolen[core] - self._stolen.get(core, 0.0), 0.0) for core in cores if core in stolen))
        self._stolen = stolen

    def _waited_s(self) -> float | None:
        try:
            with open(f"/proc/{os.getpid()}/task/{self.loop.thread_id}/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):      # not Linux, no schedstat, or the loop has not started
            return None


def _steal_seconds() -> dict[int, float]:
    """Each core's steal time (the 8th value of its ``cpuN`` line in /proc/stat, in clock ticks): time its virtual
    CPU was runnable but the host ran something else (a guest kernel without steal accounting counts it as the
    running thread's CPU time). Empty where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return {}
    return {int(row[0][3:]): int(row[8]) / os.sysconf("SC_CLK_TCK") for row in lines if len(row) > 8}
