"""blink.bench.metrics against hand-computed values. Timelines use multiples of 1/8 s, so every TTFT, TPOT, ITL and
latency is exact in binary floating point and SLO boundaries can be tested for equality."""
import math

import pytest

from blink.bench.metrics import RequestOutput, compute, max_concurrency, percentile_key, table

# A: 5 tokens in 3 chunks; B: 2 tokens in 2 chunks; C: 1 token; D: failed.
A = RequestOutput(10, start=0.0, chunk_times=[0.125, 0.375, 0.75], output_tokens=5)
B = RequestOutput(20, start=0.25, chunk_times=[0.5, 0.625], output_tokens=2)
C = RequestOutput(7, start=0.5, chunk_times=[1.0], output_tokens=1)
D = RequestOutput(30, start=0.5, error="HTTP 500: boom")
DURATION = 2.0


def test_per_request_definitions():
    assert (A.ttft, A.latency, A.itl, A.tpot) == (0.125, 0.75, [0.25, 0.375], (0.75 - 0.125) / 4)
    assert (B.ttft, B.latency, B.itl, B.tpot) == (0.25, 0.375, [0.125], 0.125)
    assert (C.ttft, C.latency, C.itl, C.tpot) == (0.5, 0.5, [], 0.0)
    assert (A.worst_gap, B.worst_gap, C.worst_gap) == (0.375, 0.125, None)
    assert not D.success and A.success
    assert not RequestOutput(3).success, "no chunk arrived: not a success even without an error"


def test_counts_and_throughputs():
    r = compute([A, B, C, D], DURATION)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 10 + 20 + 7          # the failed request's prompt does not count
    assert r["total_output_tokens"] == 5 + 2 + 1
    assert r["request_throughput"] == 3 / 2.0
    assert r["output_throughput"] == 8 / 2.0
    assert r["total_token_throughput"] == (37 + 8) / 2.0
    assert r["request_goodput"] is None
    assert r["output_lens"] == [5, 2, 1, 0]
    assert r["input_lens"] == [10, 20, 7, 30]
    assert r["ttfts"] == [0.125, 0.25, 0.5, None]
    assert r["latencies"] == [0.75, 0.375, 0.5, None]
    assert r["errors"] == ["", "", "", "HTTP 500: boom"]


def test_latency_statistics_in_ms():
    r = compute([A, B, C, D], DURATION)
    # TTFT: 125, 250, 500 ms; numpy.percentile interpolates linearly between sorted values.
    mean = (125 + 250 + 500) / 3
    assert r["mean_ttft_ms"] == pytest.approx(mean)
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt(((125 - mean) ** 2 + (250 - mean) ** 2 + (500 - mean) ** 2) / 3))
    assert r["median_ttft_ms"] == r["p50_ttft_ms"] == 250
    assert r["p90_ttft_ms"] == pytest.approx(250 + 0.8 * 250)
    assert r["p99_ttft_ms"] == pytest.approx(250 + 0.98 * 250)
    assert r["p99.9_ttft_ms"] == pytest.approx(250 + 0.998 * 250)
    # TPOT: A 156.25 and B 125 ms; C (one token) has none.
    assert r["mean_tpot_ms"] == pytest.approx(140.625)
    assert r["median_tpot_ms"] == pytest.approx(140.625)
    assert r["p90_tpot_ms"] == pytest.approx(125 + 0.9 * 31.25)
    assert r["p99_tpot_ms"] == pytest.approx(125 + 0.99 * 31.25)
    # ITL: every gap of every request: 250, 375 (A), 125 (B).
    assert r["mean_itl_ms"] == pytest.approx(250)
    assert r["median_itl_ms"] == pytest.approx(250)
    assert r["p90_itl_ms"] == pytest.approx(250 + 0.8 * 125)
    assert r["p99_itl_ms"] == pytest.approx(250 + 0.98 * 125)
    # Worst gap: one per request with two chunks or more: 375 (A), 125 (B).
    assert r["mean_worst_gap_ms"] == pytest.approx(250)
    assert r["p99_worst_gap_ms"] == pytest.approx(125 + 0.99 * 250)
    # E2EL: 750, 375, 500 ms.
    assert r["mean_e2el_ms"] == pytest.approx((750 + 375 + 500) / 3)
    assert r["median_e2el_ms"] == pytest.approx(500)
    assert r["p90_e2el_ms"] == pytest.approx(500 + 0.8 * 250)
    assert r["p99.9_e2el_ms"] == pytest.approx(500 + 0.998 * 250)


def test_steady_statistics_leave_out_requests_sent_before_the_first_answer_finished():
    # B finishes first, at 0.625 s: A, B and C were sent before it (an opening burst); E is sent at that instant, F
    # after it. Steady TTFT: E 125, F 500 ms; steady worst gap: E's 250 ms (F has one chunk).
    E = RequestOutput(5, start=0.625, chunk_times=[0.75, 1.0, 1.125], output_tokens=3)
    F = RequestOutput(5, start=1.0, chunk_times=[1.5], output_tokens=1)
    r = compute([A, B, C, D, E, F], DURATION)
    assert r["mean_steady_ttft_ms"] == pytest.approx((125 + 500) / 2)
    assert r["p99_steady_ttft_ms"] == pytest.approx(125 + 0.99 * 375)
    assert r["p50_steady_worst_gap_ms"] == r["p99_steady_worst_gap_ms"] == pytest.approx(250)
    # Over every request: TTFT 125, 250, 500, 125, 500; worst gaps 375, 125, 250.
    assert r["mean_ttft_ms"] == pytest.approx(1500 / 5)
    assert r["p99_worst_gap_ms"] == pytest.approx(250 + 0.98 * 125)
    assert compute([D], 1.0)["p99_steady_ttft_ms"] == 0


def test_goodput_counts_requests_within_every_slo_inclusive():
    # TTFT <= 250 ms: A, B. TPOT <= 125 ms: B, and C (one token counts as TPOT 0). Both: B only.
    assert compute([A, B, C, D], DURATION, slo_ttft_ms=250)["request_goodput"] == 2 / DURATION
    assert compute([A, B, C, D], DURATION, slo_tpot_ms=125)["request_goodput"] == 2 / DURATION
    assert compute([A, B, C, D], DURATION, slo_ttft_ms=250, slo_tpot_ms=125)["request_goodput"] == 1 / DURATION
    assert compute([A, B, C, D], DURATION, slo_ttft_ms=124, slo_tpot_ms=125)["request_goodput"] == 0


def test_no_successful_request_gives_zero_statistics():
    r = compute([D], 1.0)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (0, 1, 0)
    assert r["mean_ttft_ms"] == r["p99_tpot_ms"] == r["median_itl_ms"] == 0
    with pytest.raises(ValueError, match="duration must be > 0"):
        compute([A], 0.0)


def test_peak_concurrency_counts_half_open_intervals():
    # A [0, .75), B [.25, .625), C [.5, 1): all three at 0.5.
    assert max_concurrency([A, B, C, D]) == 3
    first = RequestOutput(1, start=0.0, chunk_times=[0.5], output_tokens=1)
    second = RequestOutput(1, start=0.5, chunk_times=[1.0], output_tokens=1)      # starts as the first ends
    assert max_concurrency([first, second]) == 1


def test_keys_and_table_use_vllm_names():
    assert percentile_key("ttft", 99) == "p99_ttft_ms"
    assert percentile_key("e2el", 99.9) == "p99.9_e2el_ms"
    r = compute([A, B, C, D], DURATION, slo_ttft_ms=250)
    text = table(r, request_rate=4.0, max_concurrency=None)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     3         " in lines
    assert "Failed requests:                         1         " in lines
    assert "Request rate configured (RPS):           4.00      " in lines
    assert "Request goodput (req/s):                 1.00      " in lines
    assert "Output token throughput (tok/s):         4.00      " in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Median TPOT (ms):                        140.62    " in lines
    assert "P99.9 TTFT (ms):                         499.50    " in lines
    assert "--------Worst Inter-token Gap per Request---------" in lines
    assert "P99 worst gap (ms):                      372.50    " in lines
    assert lines[-1] == "=" * 50
    assert "Request rate configured" not in table(r, request_rate=float("inf"), max_concurrency=8)
    assert "Maximum request concurrency:             8         " in table(r, float("inf"), 8).splitlines()
