"""blink.nic.metrics: ``Batched`` against the histogram's own ``observe``; the event loop thread's waits for a core
reach /metrics, as Linux's schedstat counts them for that thread, and its cores' steal time, as /proc/stat counts it.
(The stall and GC counters: tests/nic/test_agent_loop.py.)"""
import asyncio
import os
import random
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from blink.nic.metrics import Batched
from tests.nic.openai.local import run_local

RUN_DELAY = "blink_agent_run_delay_seconds_total"
STEAL = "blink_agent_cores_steal_seconds_total"
SCHEDSTAT = "/proc/thread-self/schedstat"


def waited_s() -> float:
    """The calling thread's time runnable but not running, by the kernel."""
    with open(SCHEDSTAT) as f:
        return int(f.read().split()[1]) / 1e9


@pytest.mark.skipif(not os.path.exists(SCHEDSTAT), reason="needs Linux's per-thread schedstat")
def test_the_loop_threads_waits_for_a_busy_core_are_counted(local_ring, tokenizer):
    async def scenario(local):
        before = waited_s()             # this thread runs the event loop, the agent's included
        first = (await local.metrics())[RUN_DELAY]
        allowed = os.sched_getaffinity(0)
        core = min(allowed)
        # The spinner says when it spins: a Python start on a loaded host can outlast the whole measurement.
        spinner = subprocess.Popen([sys.executable, "-u", "-c", "print('spinning')\nwhile True: pass"],
                                   stdout=subprocess.PIPE, text=True)
        try:
            assert spinner.stdout.readline() == "spinning\n"
            os.sched_setaffinity(spinner.pid, {core})
            os.sched_setaffinity(0, {core})      # this thread only: it now shares one core with the spinner
            for _ in range(10):                  # two busy threads on one core: each waits about half the time
                busy_until = time.monotonic() + 0.01
                while time.monotonic() < busy_until:
                    pass
                await asyncio.sleep(0)
        finally:
            os.sched_setaffinity(0, allowed)
            spinner.kill()
            spinner.wait()
        second = (await local.metrics())[RUN_DELAY]
        assert before <= first < second <= waited_s()
        assert second - first >= 0.001, "100 ms busy beside a spinner on one core waited at least 1 ms"

    run_local(local_ring, tokenizer, scenario, serve=True)


def steal_s(cores) -> float:
    """/proc/stat's steal of ``cores``, read here independently of blink: the 8th value of each ``cpuN`` line."""
    with open("/proc/stat") as f:
        rows = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    return sum(int(row[8]) for row in rows if int(row[0][3:]) in cores) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_the_steal_time_of_the_loop_threads_cores_is_counted(local_ring, tokenizer):
    """The counter lies between two reads of the same cores' steal around the scrape (on bare metal all three are
    0); and it counts the loop thread's cores while it may use them: pinned to one, it grows by that core's steal
    alone."""
    # Sums of /proc/stat's ticks in another order differ in the last bit; a tick is 10 ms, so this hides nothing.
    rounding = 1e-9

    async def scenario(local):
        allowed = os.sched_getaffinity(0)
        before = steal_s(allowed)
        scraped = (await local.metrics())[STEAL]
        assert before - rounding <= scraped <= steal_s(allowed) + rounding
        core = max(allowed)
        os.sched_setaffinity(0, {core})          # this thread runs the event loop
        try:
            start = steal_s({core})
            first = (await local.metrics())[STEAL]
            after_first = steal_s({core})
            await asyncio.sleep(0.3)
            before_second = steal_s({core})
            second = (await local.metrics())[STEAL]
            assert before_second - after_first - rounding <= second - first <= steal_s({core}) - start + rounding
        finally:
            os.sched_setaffinity(0, allowed)

    run_local(local_ring, tokenizer, scenario, serve=True)


async def samples(local) -> dict[tuple, float]:
    """The server's /metrics: (name, labels without model_name) -> value, and the model_name each sample carries."""
    from prometheus_client.parser import text_string_to_metric_families

    async with local.session.get(f"http://127.0.0.1:{local.port}/metrics") as response:
        text = await response.text()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            model = labels.pop("model_name", None)
            found[s.name, tuple(sorted(labels.items()))] = (s.value, model)
    return found


def test_vllms_metric_names_alias_blinks_labelled_with_the_model_name(local_ring, tokenizer):
    """What vLLM's dashboards and the Gateway API inference extension read is there under vLLM's names, with
    ``model_name`` the served name, and equals blink's own measures: the latency histograms bucket by bucket, the
    prefix cache counters, and (with requests held in the ring and the agent's queue) the running and waiting
    gauges."""
    async def scenario(local):
        for _ in range(3):
            await local.complete(max_tokens=4)
        local.engine_runs.clear()                # the engine stalls: requests wait in the ring and in the agent
        held = [asyncio.create_task(local.complete(max_tokens=4)) for _ in range(6)]
        await local.until(lambda: len(local.server.loop.waiting) == 2)
        got = await samples(local)
        local.engine_runs.set()
        await asyncio.gather(*held)

        def value(name, labels=()):
            return got[name, labels][0]
        assert {model for _, model in got.values()} == {None, "team/model"}
        assert value("vllm:num_requests_running") == value("blink_requests_running")
        assert value("vllm:num_requests_waiting") == value("blink_requests_waiting") + value("blink_requests_queued") \
            == value("blink_requests_pending")
        assert value("vllm:num_requests_waiting") >= 2
        assert value("vllm:kv_cache_usage_perc") == value("blink_kv_cache_usage_ratio")
        for vllm, blink in [("vllm:prefix_cache_queries_total", "blink_prefix_cache_queries_total"),
                            ("vllm:prefix_cache_hits_total", "blink_prefix_cache_hits_total"),
                            *[(f"vllm:spec_decode_num_{n}_total", f"blink_spec_decode_num_{n}_total")
                              for n in ("drafts", "draft_tokens", "accepted_tokens")]]:
            assert value(vllm) == value(blink) and got[vllm, ()][1] == "team/model"
        for vllm, blink in [("vllm:time_to_first_token_seconds", "blink_time_to_first_token_seconds"),
                            ("vllm:inter_token_latency_seconds", "blink_inter_token_latency_seconds"),
                            ("vllm:e2e_request_latency_seconds", "blink_e2e_request_latency_seconds")]:
            ours = {(n.replace(blink, vllm), labels): v for (n, labels), (v, _) in got.items()
                    if n.startswith(blink + "_")}
            aliases = {key: v for key, (v, model) in got.items() if key[0].startswith(vllm + "_")}
            assert aliases == ours and ours[f"{vllm}_count", ()] >= 3
            assert {got[key][1] for key in aliases} == {"team/model"}

    run_local(local_ring, tokenizer, scenario, serve=True, model_name="team/model")


def registry_samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


def test_batched_observations_publish_what_the_histograms_observe_gives():
    """Amounts on, just above and between the bounds, below the first and past the last, several at once, over
    three publishes (the second with nothing new): the histogram reads as if ``observe`` had taken each."""
    buckets = (0.001, 0.0025, 0.01, 1, 120)
    rng = random.Random(0)
    rounds = [[(b, 1) for b in buckets] + [(b * 1.0001, 2) for b in buckets] + [(0.0, 1), (500.0, 3)],
              [],
              [(rng.uniform(0, 200), rng.randint(1, 4)) for _ in range(200)]]
    reference, batched = CollectorRegistry(), CollectorRegistry()
    observed = Histogram("latency_seconds", "a latency", buckets=buckets, registry=reference)
    counted = Batched(Histogram("latency_seconds", "a latency", buckets=buckets, registry=batched))
    for amounts in rounds:
        for amount, n in amounts:
            for _ in range(n):
                observed.observe(amount)
            counted.observe(amount, n)
        counted.publish()
        want, got = registry_samples(reference), registry_samples(batched)
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-12) for k in want), (got, want)


GC_INSIDE_THE_LOCK = """
import gc
from blink.nic.metrics import Metrics
metrics = Metrics()
gc.callbacks.append(metrics.gc_phase)
gc.set_threshold(1)  # a collection at nearly every allocation, so some start inside prometheus_client's lock
for i in range(300):
    metrics.requests.labels(finish_reason=f"reason{i}").inc()  # a new child: allocates under the lock
gc.set_threshold(700)
metrics.publish()
print("passes", sum(s.value for f in metrics.own_families() for s in f.samples
                    if s.name == "blink_agent_gc_pause_seconds_count"))
"""


def test_a_gc_pass_inside_prometheus_clients_lock_does_not_hang_the_agent(tmp_path):
    """Agent processes share their metrics through files under one process-wide lock of prometheus_client's; a GC
    pass that starts while it is held (prometheus_client allocates under it) must not take it again: that hung an
    agent process for good. The passes are counted once the event loop publishes them."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", GC_INSIDE_THE_LOCK], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) > 0, run.stdout
