"""``blink generate``: one prompt through an in-process engine, against transformers' greedy continuation. (``blink
serve``, ``blink engine`` and ``blink agent`` run end to end in tests/nic/openai/test_server.py.)"""
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.privileges import may_raise_priority, run_python


QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def greedy_answer():
    """transformers' greedy 12 tokens for the chat prompt, and its tokenizer (loaded once for both rank counts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blink.models import default_model_path

    model_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    return out[0, ids.shape[1]:].tolist(), tokenizer


@pytest.mark.parametrize("ranks", ["1", "3"])   # SmolLM2's 9 query and 3 KV heads split over 3 ranks
def test_blink_generate_streams_the_greedy_answer_to_a_chat_prompt(ranks, greedy_answer):
    done = subprocess.run([sys.executable, "-m", "blink.cli", "generate", QUESTION, "--chat", "--max-tokens", "12",
                           "--device", "cpu", "--slots", "2", "--max-prompt-tokens", "64", "--max-output-tokens", "16",
                           "--cpu-kv-cache-gib", "0.05", "--tensor-parallel-size", ranks], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    want, tokenizer = greedy_answer
    assert done.stdout == tokenizer.decode(want, skip_special_tokens=True) + "\n"
    reason = "stop" if want[-1] == tokenizer.eos_token_id else "length"
    assert f"[{len(want)} tokens, finish reason: {reason}]" in done.stderr


def test_bench_client_priority_is_applied_before_the_benchmark_or_falls_back():
    """``blink bench serve --client-priority high`` raises the benchmark process's priority before it sends anything:
    without CAP_SYS_NICE it says so in one line and carries on at normal priority (here to a server that is not
    there)."""
    if may_raise_priority(unprivileged=True):
        pytest.skip("this user keeps CAP_SYS_NICE (or a raised RLIMIT_NICE): nothing to drop")
    denied = run_python("import sys; from blink.cli import main; sys.exit(main(['bench', 'serve', "
                        "'--client-priority', 'high', '--base-url', 'http://127.0.0.1:9', '--num-prompts', '1']))",
                        unprivileged=True)
    assert denied.returncode == 1 and "Traceback" not in denied.stderr, denied.stderr
    assert "--client-priority high: nice -10 (Permission denied) not permitted; running at normal." in denied.stderr
    assert "could not list the models at http://127.0.0.1:9/v1/models" in denied.stderr


def test_prefix_caching_is_on_unless_turned_off_on_the_command_line():
    from blink.cli import _engine_config, _parser

    for flags, enabled in [([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)]:
        args = _parser().parse_args(["generate", "hi", *flags])
        assert _engine_config(args, "model").scheduler.enable_prefix_caching is enabled


def test_cuda_graph_sizes_are_the_schedulers_buckets():
    from blink.cli import _engine_config, _parser

    args = _parser().parse_args(["generate", "hi", "--cuda-graph-sizes", "1", "8", "24", "2048"])
    assert _engine_config(args, "model").scheduler.buckets == (1, 8, 24, 2048)
    default = _engine_config(_parser().parse_args(["generate", "hi"]), "model").scheduler
    assert default.buckets[:8] == (1, 2, 4, 8, 16, 24, 32, 40) and default.buckets[-1] == 2048
    with pytest.raises(ValueError, match="SchedulerConfig.buckets must be a non-empty strictly increasing"):
        _engine_config(_parser().parse_args(["generate", "hi", "--cuda-graph-sizes", "8", "4", "2048"]), "model")


@pytest.mark.parametrize("option,code,message", [
    (["--poll-interval", "2"], 1, "poll_interval_s must be in [0, 1] seconds (got 2.0)"),
    (["--port", "70000"], 1, "--port must be in 0..65535, 0 for any free port (got 70000)"),
    (["--liveness-timeout", "nan"], 1, "the liveness timeout must be > 0 seconds (got nan)"),
    (["--drain-timeout", "-1"], 1, "the drain timeout must be a finite number of seconds >= 0 (got -1.0)"),
    (["--standin-step-ms", "-1"], 1, "the stand-in's step time must be in [0, 1] seconds (got -0.001)"),
    (["--cpus", "0-999999999"], 2, "core numbers are below 8192 (got '0-999999999')"),
    (["--agent-processes", "0"], 1, "--agent-processes must be 1 or more (got 0)"),
    (["--agent-processes", "300"], 1, "300 agents need a ring of at least 300 slots (it has 256): give it more "
                                      "(--slots) or run fewer agent processes (--agent-processes)"),
])
def test_a_bad_agent_option_is_refused_before_an_engine_starts(option, code, message):
    done = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "--standin", *option],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code and message in done.stderr, done.stderr
    assert "engine" not in done.stderr and "Traceback" not in done.stderr, "no engine was started"


def test_ring_key_goes_with_remote():
    done = subprocess.run([sys.executable, "-m", "blink.cli", "agent", "--ring", "blink-x", "--ring-key", "blink-x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "blink agent: --ring-key NAME goes with --remote" in done.stderr


@pytest.mark.parametrize("agents", ["1", "2"])
def test_a_port_in_use_is_one_line_not_a_traceback(agents):
    """Also for several agent processes, which would share a port with another server (SO_REUSEPORT) if asked."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                               "--agent-processes", agents], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"blink serve: cannot listen on 127.0.0.1:{port}: " in done.stderr


def test_serve_chooses_its_agent_processes_from_its_cores_and_says_so():
    """Without --agent-processes the count comes from the cores serve may use (here under a one-core affinity too),
    logged before anything starts."""
    from blink.host.agents import CORES_PER_AGENT_PROCESS, default_agent_processes

    for cores in (sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(0))[:1]):
        with socket.socket() as taken:      # serve stops once it finds its port taken
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            done = subprocess.run(["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-m", "blink.cli",
                                   "serve", "--standin", "--slots", "4", "--port", str(taken.getsockname()[1])],
                                  capture_output=True, text=True, timeout=120)
        agents = default_agent_processes(len(cores), 4)
        assert (f"{agents} agent process{'es' if agents > 1 else ''}: one per {CORES_PER_AGENT_PROCESS} of the "
                f"{len(cores)} cores this process may use (--agent-processes N to choose)") in done.stderr, done.stderr


def cached_copy(cache, model_id, revision, files):
    """A hub cache entry of ``model_id`` at ``revision`` whose snapshot holds ``files`` (name -> source path or
    text)."""
    from tests.models.test_hub import cached

    snapshot = cached(cache, model_id, files=(), revision=revision, commit=f"{revision}0123")
    for name, source in files.items():
        (snapshot / name).symlink_to(source) if isinstance(source, Path) else (snapshot / name).write_text(source)
    return snapshot


def serve_standin(*options) -> tuple[subprocess.Popen, int]:
    from tests.nic.openai.test_server import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                               "--slots", "4", "--max-model-len", "64", *options], stderr=subprocess.PIPE, text=True)
    return server, port


def post(port, path, body) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def started(server, port) -> None:
    from tests.nic.openai.test_server import _healthy, wait_for

    wait_for(lambda: server.poll() is not None or _healthy(port), timeout_s=120)
    assert server.poll() is None, server.stderr.read()


def answer_then_stop(server, port) -> tuple[str, str]:
    """The text of an unseeded sampled completion, and the server's stderr once it has stopped."""
    try:
        started(server, port)
        text = post(port, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 1.0,
                                              "ignore_eos": True})["choices"][0]["text"]
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    return text, stderr


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_vllms_model_tokenizer_seed_and_log_options(tmp_path, tokenizer):
    """``--model ID --revision R --download-dir DIR`` serve that snapshot of DIR's cache; ``--tokenizer`` is read
    from its own entry (here one whose chat template differs: /tokenize shows it in use); ``--trust-remote-code``
    and ``--disable-log-requests`` are accepted; the same ``--seed`` gives an unseeded request the same tokens in a
    restarted server, another seed others; ``--uvicorn-log-level warning`` leaves out the HTTP server's info line."""
    from blink.models import default_model_path

    source = default_model_path()
    files = {f.name: f for f in source.iterdir()}
    cached_copy(tmp_path, "org/model", "v1", files)
    config = json.loads((source / "tokenizer_config.json").read_text())
    cached_copy(tmp_path, "org/tokenizer", "main", {**files, "tokenizer_config.json":
                                                    json.dumps({**config, "chat_template": TEMPLATE})})
    server, port = serve_standin("--model", "org/model", "--revision", "v1", "--download-dir", str(tmp_path),
                                 "--tokenizer", "org/tokenizer", "--trust-remote-code", "--disable-log-requests",
                                 "--seed", "7", "--uvicorn-log-level", "warning")
    started(server, port)
    messages = [{"role": "user", "content": "hi"}]
    tokens = post(port, "/tokenize", {"messages": messages})["tokens"]
    assert tokens == tokenizer.encode("[user] hi\n", add_special_tokens=False)
    first, quiet = answer_then_stop(server, port)
    again, stderr = answer_then_stop(*serve_standin("--seed", "7"))
    other, _ = answer_then_stop(*serve_standin("--seed", "8"))
    assert first == again != other
    assert "serving" in stderr and "serving" not in quiet and "Traceback" not in quiet, quiet


@pytest.mark.parametrize("command", ["serve", "engine", "agent", "generate", "ring-demo"])
def test_help_shows_each_default_once(command, capsys):
    """An option without a value by default says in its help what leaving it out does; argparse's "(default: None)"
    after that said it a second time, and wrongly."""
    from blink.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: " in text
