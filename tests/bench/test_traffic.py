"""blink.bench.traffic: the arrival process (vLLM's gamma gaps rescaled to n / rate) and the driver that keeps to it."""
import asyncio
import itertools
import time

import numpy as np
import pytest

from blink.bench.traffic import arrival_times, send_all


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]


def test_infinite_burstiness_spaces_requests_evenly():
    assert arrival_times(4, 4.0, burstiness=float("inf")) == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_poisson_arrivals_end_at_n_over_rate_and_depend_only_on_the_seed():
    times = arrival_times(100, 8.0, seed=3)
    assert times[-1] == pytest.approx(100 / 8.0)
    assert all(a <= b for a, b in itertools.pairwise(times))
    assert arrival_times(100, 8.0, seed=3) == times
    assert arrival_times(100, 8.0, seed=4) != times


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_gaps_have_mean_one_over_rate_and_gamma_spread(burstiness):
    # Gamma(shape k, mean m) has coefficient of variation 1 / sqrt(k): 1 for Poisson, smaller when more regular.
    gaps = np.diff([0.0, *arrival_times(50_000, 10.0, burstiness, seed=0)])
    assert gaps.mean() == pytest.approx(0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_times(3, 1.0, burstiness=0.0)


def test_send_all_keeps_to_arrival_times_and_returns_outputs_in_request_order():
    sent = {}

    async def send(request):
        sent[request] = time.perf_counter()
        await asyncio.sleep(0.01 * (5 - request))       # later requests answer sooner
        return request * 10

    outputs, duration = asyncio.run(send_all(send, [0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.3, 0.4]))
    assert outputs == [0, 10, 20, 30, 40]
    start = sent[0]
    for i in range(5):
        assert sent[i] - start == pytest.approx(0.1 * i, abs=0.03)
    assert 0.41 <= duration < 0.6


def test_send_all_caps_requests_in_flight():
    in_flight, peak = 0, 0

    async def send(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return request

    outputs, duration = asyncio.run(send_all(send, list(range(6)), [0.0] * 6, max_concurrency=2))
    assert outputs == list(range(6)) and peak == 2
    assert duration >= 3 * 0.05
