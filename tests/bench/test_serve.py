"""``blink bench serve`` end to end: against ``blink serve --standin`` (the HTTP server over the reference consumer
and its stand-in model), and the transformers peer on a tiny random model. What was sent is known from the dataset
(``--ignore-eos``: the server must generate exactly each request's output length), so token totals are checked
exactly; the JSON must be strict JSON and the PNGs readable images."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from blink.bench.client import AGENT_PAUSES, AGENT_RUN_DELAY, AGENT_STEAL, SPEC_DECODE, SPEC_PER_POS
from blink.bench.datasets import synthetic
from blink.bench.shapes import write_model_dir
from blink.host.cores import cpu_list
from blink.nic.text import Tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


def strict_json(path) -> dict:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def bench(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blink.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@contextmanager
def served(*args):
    """``blink serve ARGS`` on a free port; yields its base URL once healthy."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--port", str(port), *args])
    try:
        deadline = time.monotonic() + 120
        while not healthy(port):
            assert server.poll() is None, f"blink serve {' '.join(args)} exited"
            assert time.monotonic() < deadline, f"blink serve {' '.join(args)} did not become healthy"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def standin_server():
    """``blink serve --standin`` on a free port; yields its base URL."""
    with served("--standin", "--slots", "64", "--max-prompt-tokens", "2048", "--max-output-tokens", "2048") as url:
        yield url


def test_a_run_reports_the_drafts_a_speculating_server_accepted(tmp_path):
    """``blink serve --speculative-config``: a run records the drafts verified and accepted (vLLM's counter names,
    which blink exports too) and the report says how many were accepted. Random weights at temperature 0 repeat
    themselves, so prompt lookup finds drafts."""
    model = write_model_dir(tmp_path / "tiny", "tiny-qwen3")
    result_json = tmp_path / "result.json"
    with served(str(model), "--load-format", "dummy", "--device", "cpu", "--slots", "8", "--max-model-len", "128",
                "--cpu-kv-cache-gib", "0.05", "--speculative-config", '{"num_speculative_tokens": 3}') as url:
        done = bench("serve", "--base-url", url, "--tokenizer", str(model), "--num-prompts", "4", "--input-len", "8",
                     "--output-len", "48", "--ignore-eos", "--max-concurrency", "1", "--result-json", str(result_json))
    assert done.returncode == 0, done.stderr
    (run,) = strict_json(result_json)["runs"]
    steps, drafts, accepted = (run["server"][name] for name in SPEC_DECODE)
    assert 0 < accepted <= drafts <= 3 * steps and run["total_output_tokens"] == 4 * 48
    # Per draft position (3 of them): a step that kept draft j + 1 kept draft j.
    kept = [run["server"][f"{SPEC_PER_POS}[{j}]"] for j in range(3)]
    assert sum(kept) == accepted and kept == sorted(kept, reverse=True) and kept[0] <= steps
    assert f"speculation: {accepted:.0f} of {drafts:.0f} draft tokens accepted" in done.stdout
    assert f"mean acceptance length {1 + accepted / steps:.2f}, draft 1, 2, ... kept in {kept[0] / steps:.0%}, " \
        in done.stdout


def test_every_request_asks_for_the_json_schema_given(tmp_path):
    """``--json-schema FILE``: every request carries it as ``response_format`` (a random model over a byte-level
    vocabulary); the run has no failure, and a schema the server cannot compile fails the first request."""
    pytest.importorskip("outlines_core")
    model = write_model_dir(tmp_path / "tiny", "tiny-qwen3", "bytes")
    result_json = tmp_path / "result.json"
    with served(str(model), "--load-format", "dummy", "--device", "cpu", "--slots", "8", "--max-model-len", "128",
                "--cpu-kv-cache-gib", "0.05") as url:
        done = bench("serve", "--base-url", url, "--tokenizer", str(model), "--num-prompts", "6", "--input-len", "8",
                     "--output-len", "24", "--no-ignore-eos", "--json-schema", "bench/schemas/record.json",
                     "--result-json", str(result_json))
        (tmp_path / "bad.json").write_text('{"type": "no such type"}')
        refused = bench("serve", "--base-url", url, "--tokenizer", str(model), "--num-prompts", "2", "--input-len",
                        "8", "--output-len", "24", "--no-ignore-eos", "--json-schema", str(tmp_path / "bad.json"))
    assert done.returncode == 0, done.stderr
    (run,) = strict_json(result_json)["runs"]
    assert (run["completed"], run["failed"]) == (6, 0)
    assert strict_json(result_json)["json_schema"] == "bench/schemas/record.json"
    # The schema reached the server, which refused it: the benchmark stops at its first failed request.
    assert refused.returncode != 0 and "the first request failed: HTTP 400" in refused.stderr
    assert "response_format.json_schema.schema" in refused.stderr


def test_sweep_isolated_and_colocated_writes_json_and_plots(standin_server, tmp_path):
    from blink.models import default_model_path

    result_json, plots = tmp_path / "result.json", tmp_path / "img"
    done = bench("serve", "--base-url", standin_server, "--num-prompts", "12", "--sweep", "20,inf", "--seed", "3",
                 "--ignore-eos", "--interference", "1", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500",
                 "--label", "standin", "--result-json", str(result_json), "--plot-dir", str(plots))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("============ Serving Benchmark Result ============") == 4
    result = strict_json(result_json)
    sent = synthetic(12, Tokenizer(default_model_path()).vocab_size, seed=3)
    assert [(r["condition"], r["request_rate"], r["interference"]) for r in result["runs"]] == [
        ("isolated", 20.0, 0), ("isolated", "inf", 0), ("colocated", 20.0, 1), ("colocated", "inf", 1)]
    for run in result["runs"]:
        assert (run["completed"], run["failed"], run["label"]) == (12, 0, "standin")
        assert run["input_lens"] == [r.prompt_len for r in sent]
        assert run["output_lens"] == [r.output_len for r in sent]
        assert run["total_output_tokens"] == sum(r.output_len for r in sent)
        assert all(0 < ttft <= e2e for ttft, e2e in zip(run["ttfts"], run["latencies"]))
        assert run["request_goodput"] is not None
        assert run["energy"]["available"] is False and run["energy"]["reason"]
        assert run["server"]["blink_generation_tokens_total"] == run["total_output_tokens"]
        assert {"blink_prefill_tokens_total", "blink_prefix_cache_hits_total"} <= set(run["server"])
        # The agent's own pauses, recorded per run: its stalls (their time, the part off the CPU) and GC passes.
        assert set(AGENT_PAUSES) <= set(run["server"])
        assert 0 <= run["server"]["blink_agent_stall_off_cpu_seconds_total"] <= \
            run["server"]["blink_agent_stall_seconds_total"]
        assert 0 <= run["server"][AGENT_RUN_DELAY] < run["duration"]     # the loop thread's waits for a core
        # Its cores' steal time under a hypervisor (0 on bare metal): never more than those cores' whole time.
        assert 0 <= run["server"][AGENT_STEAL] <= run["duration"] * os.cpu_count()
        # The server's CPU from its /metrics (process_cpu_seconds_total), this process's own, per 1,000 tokens.
        assert run["server_cpu_s"] == run["server"]["process_cpu_seconds_total"] > 0
        assert run["server_cpu_ms_per_1k_tokens"] > 0 and run["client_cpu_ms_per_1k_tokens"] > 0
        assert run["p99_worst_gap_ms"] >= run["median_itl_ms"] > 0
        # The server's own TTFTs nest: the ring's (submission -> first token) inside its HTTP server's (arrival ->
        # first chunk written) inside the client's, for each request and so for their means.
        assert run["server"]["blink_time_to_first_token_seconds_count"] == 12
        assert run["server"]["blink_http_time_to_first_chunk_seconds_count"] == 12
        assert 0 < run["server_mean_ttft_ms"] < run["server_http_mean_ttft_ms"] < run["mean_ttft_ms"]
        server = run["server"]
        computed = server["blink_generation_tokens_total"] + server["blink_prefill_tokens_total"]
        assert run["server_tokens_per_step"] == computed / server["blink_engine_steps_total"]
    # At 20 req/s the last of 12 requests is sent 12 / 20 s after the first.
    assert result["runs"][0]["duration"] >= 12 / 20
    assert result["sweep"] == [20.0, "inf"] and result["request_rate"] == "inf"
    import matplotlib.image

    for name in ("latency_vs_rate.png", "throughput_vs_rate.png", "isolated_vs_colocated.png"):
        image = matplotlib.image.imread(plots / name)
        assert image.shape[0] > 100 and image.shape[1] > 100
    # blink bench report reads the JSON back and plots it again.
    again = bench("report", str(result_json), "--plot-dir", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    assert "standin @ inf: colocated/isolated output throughput" in again.stdout
    assert all(column in again.stdout for column in (", P99 TTFT ", ", P99 worst gap ", "server CPU ms/1k tok",
                                                     ", steady P99 TTFT ", ", steady P99 worst gap "))
    assert again.stdout.count("standin isolated @ 20.0: agent stalls ") == 1
    assert again.stdout.count(" passes, waits for a core ") == len(result["runs"])
    assert again.stdout.count(" ms, its cores' steal ") == len(result["runs"])
    assert result["layout"] == {"name": "shared", "hog_cpus": sorted(os.sched_getaffinity(0)), "reserved": [],
                                "client_cpus": None}
    assert result["client_priority_achieved"] == "normal"
    assert sorted(os.listdir(tmp_path / "again")) == sorted(os.listdir(plots))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores this process may use")
def test_a_reserved_layout_keeps_the_hogs_off_the_reserved_cores(standin_server, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    result_json = tmp_path / "reserved.json"
    done = bench("serve", "--base-url", standin_server, "--num-prompts", "4", "--ignore-eos", "--interference", "1",
                 "--reserve-cpus", str(cores[-1]), "--result-json", str(result_json))
    assert done.returncode == 0, done.stderr
    assert f"layout reserved: hogs on cores {cpu_list(cores[:-1])}, cores {cores[-1]} kept from them" in done.stdout
    assert strict_json(result_json)["layout"] == {"name": "reserved", "hog_cpus": cores[:-1],
                                                  "reserved": [cores[-1]], "client_cpus": [cores[-1]]}


def generated_tokens(base_url: str) -> float:
    """The server's ``blink_generation_tokens_total`` now."""
    connection = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=10)
    connection.request("GET", "/metrics")
    for line in connection.getresponse().read().decode().splitlines():
        name, _, value = line.partition(" ")
        if name == "blink_generation_tokens_total":
            return float(value)
    raise AssertionError("no blink_generation_tokens_total on /metrics")


def test_warm_up_requests_reach_the_server_and_are_not_measured(standin_server, tmp_path):
    from blink.models import default_model_path

    result_json, before = tmp_path / "warm.json", generated_tokens(standin_server)
    done = bench("serve", "--base-url", standin_server, "--num-prompts", "3", "--num-warmups", "5", "--seed", "4",
                 "--ignore-eos", "--max-concurrency", "2", "--interference", "1", "--hog-kind", "cpu",
                 "--result-json", str(result_json))
    assert done.returncode == 0, done.stderr
    sent = synthetic(3, Tokenizer(default_model_path()).vocab_size, seed=4)
    runs = strict_json(result_json)["runs"]
    assert [run["condition"] for run in runs] == ["isolated", "colocated"]
    for run in runs:
        assert run["completed"] == 3 and run["total_output_tokens"] == sum(r.output_len for r in sent)
    # The lone first request, then per condition the five warm-ups (the three requests, then the first two again)
    # and the run: each condition starts from the same warm server and open connections.
    warm = [sent[i % 3].output_len for i in range(5)]
    measured = sum(run["total_output_tokens"] for run in runs)
    assert generated_tokens(standin_server) - before == sent[0].output_len + 2 * sum(warm) + measured
    refused = bench("serve", "--base-url", standin_server, "--num-prompts", "3", "--num-warmups", "-1")
    assert refused.returncode == 1 and "--num-warmups must be >= 0 (got -1)" in refused.stderr


def test_fixed_input_and_output_lengths_are_what_the_server_gets(standin_server, tmp_path):
    """``--input-len N --output-len M`` (vllm bench serve's --random-input-len / --random-output-len): every prompt
    reaches the server with N tokens and every answer has M; another dataset refuses --input-len in one line."""
    result_json = tmp_path / "fixed.json"
    done = bench("serve", "--base-url", standin_server, "--num-prompts", "4", "--input-len", "1500", "--output-len",
                 "9", "--result-json", str(result_json))
    assert done.returncode == 0, done.stderr
    run, = strict_json(result_json)["runs"]
    assert run["completed"] == 4 and run["input_lens"] == [1500] * 4 and run["output_lens"] == [9] * 4
    done = bench("serve", "--base-url", standin_server, "--dataset", "prefix", "--input-len", "10")
    assert done.returncode == 1 and "--input-len fixes the synthetic dataset's prompts" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_failing_first_request_stops_the_benchmark_naming_the_error(standin_server):
    done = bench("serve", "--base-url", standin_server, "--model", "no-such-model", "--num-prompts", "2")
    assert done.returncode == 1
    assert "the first request failed: HTTP 404" in done.stderr and "Traceback" not in done.stderr


def test_no_server_is_one_line_of_error():
    done = bench("serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert done.returncode == 1
    assert "could not list the models at" in done.stderr and "Traceback" not in done.stderr


def test_the_transformers_peer_runs_the_same_workload(tmp_path):
    model = write_model_dir(tmp_path / "tiny", "tiny-qwen3")
    result_json = tmp_path / "hf.json"
    done = bench("serve", "--backend", "hf", "--model", str(model), "--load-format", "dummy", "--device", "cpu",
                 "--num-prompts", "6", "--output-len", "8", "--sweep", "8,inf", "--ignore-eos",
                 "--result-json", str(result_json))
    assert done.returncode == 0, done.stderr
    result = strict_json(result_json)
    sent = synthetic(6, 512, seed=0, output_len=8)
    assert result["backend_info"]["device"] == "cpu"
    for run in result["runs"]:
        assert (run["completed"], run["failed"], run["label"]) == (6, 0, "hf")
        assert run["input_lens"] == [r.prompt_len for r in sent]
        assert run["output_lens"] == [8] * 6
        assert run["mean_tpot_ms"] > 0 and run["mean_itl_ms"] > 0     # 8 tokens streamed one by one


def test_a_fixed_output_length_ignores_eos_unless_told_otherwise():
    from blink.bench.serve import ignore_eos

    assert ignore_eos(None, 128) is True and ignore_eos(None, None) is False
    assert ignore_eos(False, 128) is False and ignore_eos(True, None) is True
