"""blink.bench.energy: the trapezoid integral by hand, and the meter where there is (or is not) a GPU."""
import shutil
import sys
import time

import pytest

from blink.bench.energy import EnergyMeter, integrate

HAS_NVIDIA = shutil.which("nvidia-smi") is not None


def test_integrate_is_the_trapezoid_rule():
    # 0-1 s: 100 -> 200 W (150 J); 1-3 s: 200 W flat (400 J).
    assert integrate([(0.0, 100.0), (1.0, 200.0), (3.0, 200.0)]) == 550.0
    assert integrate([(5.0, 300.0)]) == 0.0
    assert integrate([]) == 0.0


@pytest.mark.skipif(HAS_NVIDIA, reason="checks the report of a machine without a GPU")
def test_without_a_gpu_energy_is_reported_unavailable_not_raised():
    with EnergyMeter() as meter:
        time.sleep(0.01)
    result = meter.result(output_tokens=100)
    assert result["available"] is False
    assert "NVML" in result["reason"] or "nvidia-ml-py" in result["reason"]
    assert result["energy_j"] is None and result["joules_per_output_token"] is None


def test_without_nvidia_ml_py_energy_is_unavailable_and_names_the_bench_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)          # `import pynvml` raises ImportError
    with EnergyMeter() as meter:
        pass
    result = meter.result(output_tokens=100)
    assert result["available"] is False and "pip install 'blink-serve[bench]'" in result["reason"]


@pytest.mark.gpu
def test_on_a_gpu_power_is_sampled_and_integrated():
    with EnergyMeter(interval_s=0.02) as meter:
        time.sleep(0.5)
    result = meter.result(output_tokens=1000)
    assert result["available"] is True and result["gpus"]
    assert result["samples"] >= 10
    assert 10 < result["mean_power_w"] < 2000 * len(result["gpus"])        # idle to full board power
    assert result["energy_j"] == pytest.approx(integrate(meter.samples))
    assert result["joules_per_output_token"] == pytest.approx(result["energy_j"] / 1000)
