"""``blink`` command line."""
from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import os
import sys
import time
from contextlib import contextmanager

import numpy as np

from blink.device.reference import standin_engine
from blink.errors import BlinkError

_ring_numbers = itertools.count()
# Errors that say what was wrong and what to do: shown as one line, without a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, BlinkError)


@contextmanager
def engine_process(config):
    """The engine (``blink.engine.serve_ring``) in another process, on the shared-memory ring it creates.

    Yields ``(memory, process)`` once the ring exists; on exit asks the engine to shut down through the ring, waits
    for the process, and removes the ring if the engine could not.
    """
    from blink.device.ring import CONTROL_DTYPE
    from blink.nic.transport import SharedMemory

    process = mp.get_context("spawn").Process(target=_engine_entry, args=(config, os.getpid()), daemon=True)
    process.start()
    memory = None
    try:
        memory = _attach_ring(config, process)
        yield memory, process
    finally:
        if memory is not None:
            memory.write(CONTROL_DTYPE.fields["shutdown"][1], np.array([1], "<u4").tobytes())
            memory.close()
        process.join(60)
        if process.is_alive():
            process.terminate()
            process.join(10)
            process.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SharedMemory.SHM_DIR, config.ring_name))


def _engine_entry(config, parent: int) -> None:
    """``engine_process``'s target: the engine until shutdown, a start-up error reported in one line."""
    from blink.engine import serve_ring

    _stop_with_parent(parent)
    try:
        serve_ring(config)
    except USER_ERRORS as e:
        print(f"blink engine: {e}", file=sys.stderr)
        sys.exit(1)


def _stop_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies (Linux), so a killed ``blink serve`` leaves no engine behind;
    ``serve_ring`` turns SIGTERM into a clean stop that removes the ring."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:      # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _attach_ring(config, process, timeout_s: float = 600.0):
    """Open the ring the engine process creates (it exists once it has its full size and its magic word)."""
    from blink.device.ring import MAGIC, RingLayout
    from blink.nic.transport import SharedMemory

    size = RingLayout(config.geometry()).size
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            memory = SharedMemory.open(config.ring_name, size)
        except (FileNotFoundError, ValueError):
            memory = None       # not created yet, or not yet resized to its full size
        if memory is not None:
            if int(np.frombuffer(memory.read(0, 4), "<u4")[0]) == MAGIC:
                return memory
            memory.close()
        if not process.is_alive():
            raise SystemExit(f"the engine process exited (code {process.exitcode}) before it created its ring")
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine did not create its ring /dev/shm/{config.ring_name} within {timeout_s:.0f} s")
        time.sleep(0.05)


def wait_until_serving(agent, engine=None, timeout_s: float = 600.0) -> None:
    """Block until the ring's engine reports it is serving; ``SystemExit`` saying why if it does not."""
    from blink.device.ring import ENGINE_STARTING

    deadline = time.monotonic() + timeout_s
    while agent.stats()["engine_state"] == ENGINE_STARTING:
        if engine is not None and not engine.is_alive():
            raise SystemExit(f"the engine process exited (code {engine.exitcode}) before it started serving")
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine did not start serving within {timeout_s:.0f} s: is it running on this ring?")
        time.sleep(0.01)


def ring_demo(args) -> int:
    """Agent in this process, the reference consumer (playing the GPU) in another, over POSIX shared memory."""
    from blink.config import SamplingParams
    from blink.device.ring import RingGeometry
    from blink.device.standin import standin_continuation
    from blink.errors import RingFull
    from blink.nic.agent import Agent

    geometry = RingGeometry(n_slots=args.slots, max_prompt_tokens=64, max_output_tokens=args.max_tokens)
    rng = np.random.default_rng(args.seed)
    with standin_engine(geometry) as (memory, _):
        agent = Agent(memory, geometry)
        expected, answered, finished, tokens = {}, {}, 0, 0
        start = last_report = time.monotonic()
        while finished < args.requests:
            while len(expected) < args.requests:
                prompt = rng.integers(0, 32000, rng.integers(1, 65)).tolist()
                params = SamplingParams(max_tokens=int(rng.integers(1, args.max_tokens + 1)),
                                        seed=int(rng.integers(0, 2**63)), ignore_eos=True)
                try:
                    expected[agent.submit(prompt, params)] = (prompt, params)
                except RingFull:
                    break
            for out in agent.poll():
                answered.setdefault(out.request_id, []).extend(out.new_tokens)
                tokens += len(out.new_tokens)
                finished += out.finished
            now = time.monotonic()
            if now - last_report >= 0.5 or finished == args.requests:
                print(f"  {now - start:6.2f} s  submitted {len(expected):6d}  in flight {agent.in_flight:5d}  "
                      f"tokens {tokens:8d}  ({tokens / (now - start):,.0f} tok/s)")
                last_report = now
        wrong = [rid for rid, (prompt, params) in expected.items()
                 if answered[rid] != standin_continuation(prompt, params.seed, params.max_tokens)]
        elapsed = time.monotonic() - start
        print(f"{args.requests} requests, {tokens} tokens in {elapsed:.2f} s "
              f"({args.requests / elapsed:,.0f} req/s); wrong outputs: {len(wrong)}")
        return 1 if wrong else 0


def serve(args) -> int:
    """The engine in another process and the agent's HTTP server in this one, over a shared-memory ring."""
    from blink.nic.text import Tokenizer

    model_dir = _model_dir(args.model_path or args.model)
    tokenizer = Tokenizer(model_dir)
    if args.standin:
        geometry = _engine_config(args, model_dir).geometry()
        # The stand-in draws tokens from the tokenizer's whole vocabulary, so every token it emits decodes.
        engine = standin_engine(geometry, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids)
    else:
        config = _engine_config(args, model_dir, ring_name=f"blink-{os.getpid()}-{next(_ring_numbers)}")
        geometry = config.geometry()
        engine = engine_process(config)
    with engine as (memory, process):
        _split_cores(args, process)
        return _serve_http(args, memory, geometry, tokenizer, model_dir, process)


def _split_cores(args, process) -> None:
    """Unless ``--cpus`` says otherwise, give the agent the last core this process may use and the engine the rest,
    so HTTP and tokenization never compete with the engine (where the OS supports affinity, with >= 2 cores)."""
    if args.cpus or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return
    args.cpus = [cores[-1]]
    try:
        os.sched_setaffinity(process.pid, cores[:-1])
    except OSError as e:                       # the engine may have exited already: the agent reports that
        print(f"could not pin the engine process to cores {cores[:-1]}: {e}", file=sys.stderr)


def engine(args) -> int:
    """The engine on a new shared-memory ring until Ctrl-C or SIGTERM; ``blink agent --ring NAME`` serves HTTP on it."""
    from blink.engine import serve_ring

    serve_ring(_engine_config(args, _model_dir(args.model_path or args.model), ring_name=args.ring))
    return 0


def generate(args) -> int:
    """One prompt through an in-process engine; the text streams to stdout."""
    from blink.config import SamplingParams
    from blink.engine import Engine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    with Engine(_engine_config(args, _model_dir(args.model))) as llm:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        stream = llm.stream(prompt, params)
        for delta in stream:
            print(delta.text, end="", flush=True)
        print()
        print(f"[{len(stream.output.token_ids)} tokens, finish reason: {stream.output.finish_reason}]", file=sys.stderr)
    return 0


def agent(args) -> int:
    """Attach to the shared-memory ring of an engine that is already running and serve HTTP on it."""
    from blink.nic.text import Tokenizer
    from blink.nic.transport import SharedMemory

    model_dir = _model_dir(args.model)
    with SharedMemory.open(args.ring) as memory:
        return _serve_http(args, memory, _ring_geometry(memory), Tokenizer(model_dir), model_dir, None)


def _serve_http(args, memory, geometry, tokenizer, model_dir, engine) -> int:
    import logging
    from pathlib import Path

    from blink.nic.agent import Agent
    from blink.nic.server import OpenAIServer, ServerConfig, run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)      # keep the agent off the engine's cores
    set_priority(args.agent_priority)           # before any thread starts: threads inherit it
    agent = Agent(memory, geometry)
    wait_until_serving(agent, engine)
    config = ServerConfig(model_name=args.served_model_name or Path(model_dir).name, max_queued=args.max_queued)
    run(OpenAIServer(agent, tokenizer, config), args.host, args.port)
    return 0


PRIORITIES = ("normal", "high", "realtime")


def set_priority(level: str, option: str = "--agent-priority") -> None:
    """Raise the calling process's CPU priority for a host shared with noisy neighbours: the agent's (the only host
    process on the per-token path; the engine process only sleeps) or a benchmark client's. ``high``: nice -10, so
    where busy processes at nice 0 share a core this one gets ~10x their CPU share and its wake-ups preempt them.
    ``realtime``: SCHED_RR 10, so it runs whenever it is runnable; it sleeps between polls, and Linux keeps 5% of
    every core for normal tasks. Both need CAP_SYS_NICE (root) or a raised RLIMIT_NICE / RLIMIT_RTPRIO; processes
    started afterwards inherit the priority (``serve`` starts the engine first). ``option`` names the command-line
    option in the error."""
    if level not in PRIORITIES:
        raise ValueError(f"{option} must be one of {', '.join(PRIORITIES)} (got {level!r})")
    try:
        if level == "high":
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        elif level == "realtime":
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
    except PermissionError as e:
        raise SystemExit(f"{option} {level}: not permitted ({e.strerror}); it needs CAP_SYS_NICE (root) or a "
                         f"raised RLIMIT_NICE / RLIMIT_RTPRIO. Use {option} normal.") from None


def _model_dir(model):
    if model is not None:
        return model
    from blink.models import default_model_path
    return default_model_path()


def _engine_config(args, model_dir, **overrides):
    from blink.config import EngineConfig

    return EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        num_pages=args.num_pages, gpu_memory_utilization=args.gpu_memory_utilization,
                        cpu_kv_cache_gib=args.cpu_kv_cache_gib, n_slots=args.slots,
                        max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                        load_format=args.load_format, **overrides)


def _ring_geometry(memory):
    """The geometry an existing ring's creator wrote into its control block."""
    from blink.device.ring import CONTROL_DTYPE, MAGIC, RING_LOGPROBS, RingGeometry

    control = np.frombuffer(memory.read(0, CONTROL_DTYPE.itemsize), CONTROL_DTYPE)[0]
    if int(control["magic"]) != MAGIC:
        raise SystemExit(f"/dev/shm/{memory.name} is not a blink ring (or its engine has not initialised it yet)")
    return RingGeometry(n_slots=int(control["n_slots"]), max_prompt_tokens=int(control["max_prompt_tokens"]),
                        max_output_tokens=int(control["max_output_tokens"]),
                        max_stop_ids=int(control["max_stop_ids"]),
                        logprobs=bool(int(control["flags"]) & RING_LOGPROBS))


def _cpu_list(text: str) -> set[int]:
    return {int(c) for c in text.split(",")}


def _engine_options(parser, slots: int) -> None:
    """Model, device, memory and ring sizes (``EngineConfig``)."""
    from blink.config import DEVICES, LOAD_FORMATS, EngineConfig

    d = EngineConfig()
    parser.add_argument("--device", choices=DEVICES, default=d.device, help="auto: the GPU if there is one")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                        help="dummy: random weights, only config.json is read (benchmarks of large shapes)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="default: the checkpoint's on a GPU, float32 on the CPU")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from the memory options)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=d.cpu_kv_cache_gib)
    parser.add_argument("--slots", type=int, default=slots, help="ring request slots")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)


def _http_options(parser) -> None:
    parser.add_argument("--model", default=None, help="model directory (HF layout); default: the embedded SmolLM2")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the dir name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queued", type=int, default=1024,
                        help="requests that may wait in the agent for a free ring slot; beyond it: 429")
    parser.add_argument("--agent-priority", choices=PRIORITIES, default="normal",
                        help="CPU priority of the agent on a shared host: high = nice -10, realtime = SCHED_RR "
                             "(both need CAP_SYS_NICE)")
    parser.add_argument("--cpus", type=_cpu_list, default=None,
                        help="pin the agent to these cores, e.g. 2,3 (serve's default: the last core, the engine on "
                             "the others)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="blink", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("ring-demo", help="agent and reference consumer in two processes over shared memory")
    demo.add_argument("--requests", type=int, default=5000)
    demo.add_argument("--slots", type=int, default=1024)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=ring_demo)
    serve_cmd = sub.add_parser("serve", help="engine + OpenAI-compatible HTTP server (agent) over a shared ring")
    serve_cmd.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    _http_options(serve_cmd)
    _engine_options(serve_cmd, slots=256)
    serve_cmd.add_argument("--standin", action="store_true",
                           help="run the reference consumer with the stand-in model as the engine")
    serve_cmd.set_defaults(run=serve)
    engine_cmd = sub.add_parser("engine", help="the engine alone, on a new shared-memory ring (see: blink agent)")
    engine_cmd.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    engine_cmd.add_argument("--model", default=None, help="model directory (HF layout); default: the embedded SmolLM2")
    engine_cmd.add_argument("--ring", required=True, help="name of the ring to create (/dev/shm/NAME)")
    _engine_options(engine_cmd, slots=256)
    engine_cmd.set_defaults(run=engine)
    gen_cmd = sub.add_parser("generate", help="generate from one prompt with an in-process engine")
    gen_cmd.add_argument("prompt")
    gen_cmd.add_argument("--model", default=None, help="model directory (HF layout); default: the embedded SmolLM2")
    gen_cmd.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen_cmd.add_argument("--max-tokens", type=int, default=128)
    gen_cmd.add_argument("--temperature", type=float, default=0.0)
    gen_cmd.add_argument("--top-p", type=float, default=1.0)
    gen_cmd.add_argument("--top-k", type=int, default=0)
    gen_cmd.add_argument("--seed", type=int, default=None)
    gen_cmd.add_argument("--ignore-eos", action="store_true")
    _engine_options(gen_cmd, slots=4)
    gen_cmd.set_defaults(run=generate)
    agent_cmd = sub.add_parser("agent", help="OpenAI-compatible HTTP server on the ring of a running engine")
    _http_options(agent_cmd)
    agent_cmd.add_argument("--ring", required=True, help="the engine's shared-memory ring name (/dev/shm/NAME)")
    agent_cmd.set_defaults(run=agent)
    bench_cmd = sub.add_parser("bench", help="benchmarks: serve (online serving, vllm bench serve's metrics), report")
    from blink.bench.serve import add_parsers
    add_parsers(bench_cmd.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as e:
        print(f"blink {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
