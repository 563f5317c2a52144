"""blink.bench.client's reading of a server's /metrics: Prometheus text as blink's agent and vLLM 0.26 write it."""
from blink.bench.client import CPU_COUNTER, parse_counters, tokens_per_step

BLINK = """# HELP blink_engine_steps_total Model steps launched
# TYPE blink_engine_steps_total counter
blink_engine_steps_total 40.0
blink_generation_tokens_total 300.0
blink_prefill_tokens_total 100.0
blink_requests_running 3.0
process_cpu_seconds_total 1.5
"""
# vLLM labels each series with the model (and, with several engines, their index): the same name sums over them.
VLLM = """# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="/tmp/qwen3 8b"} 600.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="/tmp/qwen3 8b"} 2.0
vllm:iteration_tokens_total_count{engine="0",model_name="/tmp/qwen3 8b"} 10.0
vllm:iteration_tokens_total_sum{engine="1",model_name="/tmp/qwen3 8b"} 200.0
vllm:iteration_tokens_total_count{engine="1",model_name="/tmp/qwen3 8b"} 10.0
process_cpu_seconds_total 2.25
"""


def test_blink_counters_and_its_tokens_per_step():
    counters = parse_counters(BLINK)
    assert counters == {"blink_engine_steps_total": 40.0, "blink_generation_tokens_total": 300.0,
                        "blink_prefill_tokens_total": 100.0, CPU_COUNTER: 1.5}
    assert tokens_per_step(counters) == 10.0


def test_vllm_series_are_summed_over_their_labels():
    counters = parse_counters(VLLM)
    assert counters == {"vllm:iteration_tokens_total_sum": 800.0, "vllm:iteration_tokens_total_count": 20.0,
                        CPU_COUNTER: 2.25}
    assert tokens_per_step(counters) == 40.0


def test_no_steps_no_tokens_per_step():
    assert tokens_per_step(None) is None and tokens_per_step({CPU_COUNTER: 1.0}) is None
    assert tokens_per_step({"blink_engine_steps_total": 0.0, "blink_generation_tokens_total": 5.0,
                            "blink_prefill_tokens_total": 1.0}) is None
