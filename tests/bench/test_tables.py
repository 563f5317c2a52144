"""blink.bench.tables: ``blink bench report --markdown``, each run of the result JSONs one Markdown row, its numbers
written as the serving tables of docs/benchmarks/ write them, n/a where a run lacks one."""
import json
import subprocess
import sys

from blink.bench.tables import COLUMNS, markdown

RUN = {"label": "blink", "interference": 64, "request_rate": "inf", "max_concurrency": 64, "output_throughput": 3633.94,
       "p50_ttft_ms": 168.29, "p99_ttft_ms": 353.96, "p50_tpot_ms": 7.891, "p99_tpot_ms": 10.498,
       "p50_itl_ms": 3.991, "p99_itl_ms": 79.13, "p99_worst_gap_ms": 125.88,
       "energy": {"joules_per_output_token": 0.14134, "mean_power_w": 511.6}, "server_cpu_ms_per_1k_tokens": 1234.4,
       "server_tokens_per_step": 57.26}
# A peer without an energy meter, /metrics or worst gaps, isolated, at a finite rate.
BARE = {"label": "hf", "interference": 0, "request_rate": 16.0, "output_throughput": 29.6, "p50_ttft_ms": 142.5,
        "p99_ttft_ms": 142.5, "p50_tpot_ms": 145.55, "p99_tpot_ms": 152.1, "p50_itl_ms": 137.47, "p99_itl_ms": 188.02,
        "energy": {"joules_per_output_token": None, "mean_power_w": None}, "server_cpu_ms_per_1k_tokens": None}


def test_each_run_is_one_row_under_the_headings():
    header, rule, full, bare = markdown([RUN, BARE]).splitlines()
    assert header == "| " + " | ".join(heading for heading, _ in COLUMNS) + " |"
    assert rule.count("|") == len(COLUMNS) + 1
    assert full == ("| blink | 64 hogs | inf | 64 | 3,633.9 | 168.3 / 354.0 | 7.89 / 10.50 | 3.99 / 79.13 | 125.9 | "
                    "0.1413 | 512 | 1,234.4 | 57.3 |")
    assert bare == ("| hf | isolated | 16.0 | - | 29.6 | 142.5 / 142.5 | 145.55 / 152.10 | 137.47 / 188.02 | n/a | "
                    "n/a | n/a | n/a | n/a |")


def test_report_prints_the_table_of_its_files(tmp_path):
    paths = []
    for i, runs in enumerate(([RUN], [BARE])):
        paths.append(tmp_path / f"result{i}.json")
        paths[-1].write_text(json.dumps({"runs": runs}))
    done = subprocess.run([sys.executable, "-m", "blink.cli", "bench", "report", *map(str, paths), "--markdown"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == markdown([RUN, BARE])
