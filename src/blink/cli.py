"""``blink`` command line: argparse and thin commands over ``blink.process`` (engine processes), ``blink.engine``
(in-process generation) and ``blink.nic.openai`` (the HTTP agent)."""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import uuid

from blink.priority import PRIORITIES
from blink.process import USER_ERRORS
from blink.ring.split import REQUEST_SIDES

_ring_numbers = itertools.count()


def ring_demo(args) -> int:
    from blink.demo import ring_demo

    return ring_demo(args.slots, args.requests, args.max_tokens, args.seed)


def serve(args) -> int:
    """The engine in another process and the agent's HTTP server in this one, over a shared-memory ring."""
    from blink.process import engine_process, split_cores
    from blink.ring.reference import standin_engine

    configs = _agent_configs(args)      # checked before the engine starts
    model_dir = _model_dir(args.model_path or args.model)
    tokenizer = _tokenizer(args, model_dir)
    if args.standin:
        from blink.config import DEFAULT_MAX_MODEL_LEN

        config = _engine_config(args, model_dir)
        geometry = config.geometry(config.max_model_len(tokenizer.context_len or DEFAULT_MAX_MODEL_LEN))
        # The stand-in draws tokens from the tokenizer's whole vocabulary, so every token it emits decodes.
        engine = standin_engine(geometry, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids,
                                step_s=args.standin_step_ms / 1e3)
    else:
        engine = engine_process(_engine_config(args, model_dir, ring_name=_ring_name()))
    with engine as (memory, process), split_cores(process, args.cpus, args.reserve_agent_cores) as cores:
        return _serve_http(args, configs, memory, tokenizer, model_dir, process, cores)


def engine(args) -> int:
    """The engine on a new shared-memory ring until Ctrl-C or SIGTERM; ``blink agent --ring NAME`` serves HTTP on it."""
    from blink.process import serve_ring

    serve_ring(_engine_config(args, _model_dir(args.model_path or args.model), ring_name=args.ring,
                              request_side=args.request_side),
               listen=args.listen, rdma_device=_rdma_device(args))
    return 0


def generate(args) -> int:
    """One prompt through an in-process engine; the text streams to stdout."""
    from blink.engine import Engine
    from blink.ring.request import SamplingParams

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
    """Attach to the ring of an engine that is already running (by name on this host, or at ``--remote`` over RDMA
    or CUDA IPC) and serve HTTP on it."""
    from blink.process import split_cores

    configs = _agent_configs(args)
    model_dir = _model_dir(args.model)
    with _agent_ring(args) as memory, split_cores(None, args.cpus, args.reserve_agent_cores) as cores:
        return _serve_http(args, configs, memory, _tokenizer(args, model_dir), model_dir, None, cores)


def _agent_configs(args):
    """The agent's loop and drain configs, every HTTP option checked: before an engine starts loading a model."""
    from blink.nic.agent_loop import LoopConfig
    from blink.nic.drain import DrainConfig
    from blink.nic.liveness import Liveness

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, 0 for any free port (got {args.port})")
    Liveness(args.liveness_timeout)             # raises on a bad --liveness-timeout, as the agent would
    return (LoopConfig(max_queued=args.max_queued, poll_interval_s=args.poll_interval),
            DrainConfig(timeout_s=args.drain_timeout))


def _agent_ring(args):
    if args.ring is not None:
        from blink.ring.transport import SharedMemory

        return SharedMemory.open(args.ring)
    from blink.nic.remote import open_remote

    return open_remote(args.remote, args.transport, device=_rdma_device(args))


def _rdma_device(args):
    from blink.nic.ibverbs import DeviceConfig

    return DeviceConfig(device=args.rdma_device, port=args.rdma_port, gid_index=args.rdma_gid_index)


def _rdma_options(parser) -> None:
    parser.add_argument("--rdma-device", default=None, help="RDMA device (ibv_devices; default: the only one)")
    parser.add_argument("--rdma-port", type=int, default=1, help="RDMA device port")
    parser.add_argument("--rdma-gid-index", type=int, default=0,
                        help="GID table entry (show_gids; a RoCE v2 entry with the interface's address)")


def _serve_http(args, configs, memory, tokenizer, model_dir, engine_process, cores) -> int:
    """The HTTP agent on ``memory``'s ring until Ctrl-C / SIGTERM (exit 0) or until its engine is gone (exit 1: the
    engine is not restarted here; a supervisor restarts the whole server)."""
    from blink.nic.agent import Agent
    from blink.nic.defaults import sampling_defaults
    from blink.nic.openai.server import OpenAIServer, ServerConfig, run
    from blink.priority import helper_priority, pin, set_priority
    from blink.process import engine_watch

    set_priority(args.agent_priority)           # before any thread starts: threads inherit it
    if cores:
        pin(cores, named=bool(args.cpus))       # keep the agent off the engine's cores
    agent = Agent.attach(memory, liveness_timeout_s=args.liveness_timeout)
    loop, drain = configs
    config = ServerConfig(model_name=args.served_model_name or os.path.basename(model_dir), loop=loop,
                          api_key=args.api_key or os.environ.get("BLINK_API_KEY") or None,
                          defaults=sampling_defaults(model_dir, args.generation_config), drain=drain,
                          thread_start=helper_priority)
    # Listening while the engine starts: /livez 200, /readyz 503 "starting" (docs/deploy.md).
    server = OpenAIServer(agent, tokenizer, config, engine_gone=engine_watch(agent, engine_process))
    return run(server, args.host, args.port)


def _tokenizer(args, model_dir):
    from blink.nic.text import Tokenizer, chat_template_argument

    return Tokenizer(model_dir, chat_template=chat_template_argument(args.chat_template),
                     special_tokens_in_content=not args.special_tokens_as_text)


def _ring_name() -> str:
    """A fresh shared-memory name: the pid alone repeats (PID 1 in every container), a random part does not."""
    return f"blink-{os.getpid()}-{next(_ring_numbers)}-{uuid.uuid4().hex[:8]}"


def _model_dir(model):
    from blink.models import default_model_path, resolve_model

    return resolve_model(model) if model is not None else default_model_path()


def _engine_config(args, model_dir, **overrides):
    from blink.config import EngineConfig, SchedulerConfig

    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                page_size=args.block_size, num_pages=args.num_pages,
                                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                                buckets=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None)
    return EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype, scheduler=scheduler,
                        policy=args.policy, gpu_memory_utilization=args.gpu_memory_utilization,
                        cpu_kv_cache_gib=args.cpu_kv_cache_gib, n_slots=args.slots, quantization=args.quantization,
                        max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                        load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size, **overrides)


def _cpu_list(text: str) -> list[int]:
    from blink.cores import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_options(parser, slots: int) -> None:
    """Model, device, memory, scheduler and ring sizes (``EngineConfig``, ``SchedulerConfig``)."""
    from blink.config import DEVICES, DTYPES, LOAD_FORMATS, QUANTIZATIONS, EngineConfig, SchedulerConfig
    from blink.device.config import MAX_BUCKETS

    d, s = EngineConfig(), SchedulerConfig()
    parser.add_argument("--device", choices=DEVICES, default=d.device, help="auto: the GPU if there is one")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                        help="dummy: random weights, only config.json is read (benchmarks of large shapes)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="default: the checkpoint's on a GPU, float32 on the CPU")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="fp8: FP8 projections, quantized at load")
    parser.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs, help="most sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                        help="most tokens in one step (the largest captured step graph)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output positions of one sequence (default: the model's context, at most 4096)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                        help=f"token counts of the captured step graphs, increasing, at most {MAX_BUCKETS} (a step "
                             "runs in the smallest that holds it, its other rows padding); default: 1 2 4 8, then "
                             "four sizes per doubling in steps of at least 8, up to --max-num-batched-tokens")
    parser.add_argument("--block-size", type=int, default=s.page_size, help="tokens per KV page")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=s.enable_prefix_caching, help="reuse the KV pages of shared prompt prefixes")
    parser.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                        help="split the model over this many processes (the CPU only, so far)")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from the memory options)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="share of the GPU's memory for weights, activations and the KV cache")
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=d.cpu_kv_cache_gib, help="KV cache size on the CPU")
    parser.add_argument("--policy", default=None, metavar="MODULE:FUNCTION",
                        help="admission policy: a numba device function (docs/scheduler.md); default: first come, "
                             "first served")
    parser.add_argument("--slots", type=int, default=slots, help="ring request slots")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt a ring slot holds (default: max-model-len - 1)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="longest output a ring slot holds (default: max-model-len - 1)")


def _http_options(parser) -> None:
    from blink.nic.agent_loop import LoopConfig

    parser.add_argument("--model", default=None, help="a model directory (HF layout) or a model id in the local "
                        "Hugging Face cache; default: the embedded SmolLM2")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the dir name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--max-queued", type=int, default=LoopConfig.max_queued,
                        help="requests that may wait in the agent for a free ring slot; beyond it: 429")
    parser.add_argument("--poll-interval", type=float, default=LoopConfig.poll_interval_s,
                        help="seconds the agent sleeps after a ring poll that found no tokens while requests are in "
                             "flight; 0: it polls without sleeping (a core busy while it serves, and no wake-up that "
                             "waits for a busy core; see docs/serving.md)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $BLINK_API_KEY if set, "
                             "else no key)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself (default: the model's chat_template.jinja "
                             "or tokenizer_config.json)")
    parser.add_argument("--generation-config", default="auto",
                        help="default sampling: auto (the model's generation_config.json), vllm (the OpenAI API's "
                             "defaults) or a directory holding a generation_config.json")
    parser.add_argument("--special-tokens-as-text", action="store_true",
                        help="encode special tokens' text inside chat messages as plain text (default: as the special "
                             "tokens, like transformers and vLLM; see docs/serving.md)")
    parser.add_argument("--liveness-timeout", type=float, default=10.0,
                        help="seconds the engine may show no sign of life (outside a long step) before requests "
                             "get 503")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds the first SIGTERM / Ctrl-C waits for the requests in flight (new ones get 503) "
                             "before it ends the rest with an error and exits; a second one exits at once")
    parser.add_argument("--agent-priority", choices=PRIORITIES, default="auto",
                        help="CPU priority of the agent on a shared host: high = nice -10, realtime = SCHED_RR, "
                             "deadline = SCHED_DEADLINE with half a core's budget, not pinned (all need "
                             "CAP_SYS_NICE; refused, the agent runs at the best level permitted and says so), "
                             "auto = high where permitted, else the best below")
    parser.add_argument("--cpus", type=_cpu_list, default=None,
                        help="pin the agent to these cores, e.g. 2,3 (default: the least busy core this process may "
                             "use that no other blink server claims; serve pins the engine to the others)")
    parser.add_argument("--reserve-agent-cores", action=argparse.BooleanOptionalAction, default=False,
                        help="give the agent's cores to it alone: a cgroup v2 cpuset partition no other process on "
                             "the host may run on, removed at exit (needs root and cgroup v2; refused, the agent "
                             "runs without it and says why)")


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="blink", description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, run, help):
        p = sub.add_parser(name, help=help, description=help, formatter_class=formatter)
        p.set_defaults(run=run)
        return p

    demo = command("ring-demo", ring_demo, "agent and reference consumer in two processes over shared memory")
    demo.add_argument("--requests", type=int, default=5000, help="requests to send")
    demo.add_argument("--slots", type=int, default=1024, help="ring request slots")
    demo.add_argument("--max-tokens", type=int, default=32, help="longest output")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    serve_cmd = command("serve", serve, "engine + OpenAI-compatible HTTP server (agent) over a shared ring")
    serve_cmd.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    _http_options(serve_cmd)
    _engine_options(serve_cmd, slots=256)
    serve_cmd.add_argument("--standin", action="store_true",
                           help="run the reference consumer with the stand-in model as the engine")
    serve_cmd.add_argument("--standin-step-ms", type=float, default=0.0,
                           help="with --standin: the least time between its steps, as a GPU's decode step (0: no "
                                "pause; benchmarks of the agent use ~10)")
    engine_cmd = command("engine", engine, "the engine alone, on a new shared-memory ring (see: blink agent)")
    engine_cmd.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    engine_cmd.add_argument("--model", default=None, help="model directory (HF layout); default: the embedded SmolLM2")
    engine_cmd.add_argument("--ring", required=True, help="name of the ring to create (/dev/shm/NAME)")
    engine_cmd.add_argument("--listen", default=None, metavar="HOST:PORT",
                            help="also let agents on other hosts or DPUs attach here (docs/dpu.md)")
    engine_cmd.add_argument("--request-side", choices=REQUEST_SIDES, default=REQUEST_SIDES[0],
                            help="where the ring's request side lives: host memory, or GPU memory (a GPU engine with "
                                 "--listen: agents attach only through the listener, a NIC writes it directly)")
    _rdma_options(engine_cmd)
    _engine_options(engine_cmd, slots=256)
    gen_cmd = command("generate", generate, "generate from one prompt with an in-process engine")
    gen_cmd.add_argument("prompt", help="the prompt text")
    gen_cmd.add_argument("--model", default=None, help="model directory (HF layout); default: the embedded SmolLM2")
    gen_cmd.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen_cmd.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen_cmd.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen_cmd.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen_cmd.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    gen_cmd.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    gen_cmd.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    _engine_options(gen_cmd, slots=4)
    agent_cmd = command("agent", agent, "OpenAI-compatible HTTP server on the ring of a running engine")
    _http_options(agent_cmd)
    where = agent_cmd.add_mutually_exclusive_group(required=True)
    where.add_argument("--ring", default=None, help="the engine's shared-memory ring name (/dev/shm/NAME)")
    where.add_argument("--remote", default=None, metavar="HOST:PORT",
                       help="the engine's --listen address: attach over --transport")
    agent_cmd.add_argument("--transport", choices=("rdma", "ipc"), default="rdma",
                           help="with --remote: RDMA (a DPU or another host) or CUDA IPC (the same host)")
    _rdma_options(agent_cmd)
    bench_cmd = sub.add_parser("bench", help="benchmarks: serve (online serving, vllm bench serve's metrics), report")
    bench_cmd.set_defaults(run=None)
    bench_sub = bench_cmd.add_subparsers(dest="bench_command", required=True)
    try:
        from blink.bench.serve import add_parsers
    except ImportError as e:            # the bench extra is not installed
        message = f"blink bench needs the bench extra ({e.name} is missing): pip install 'blink[bench]'"
        bench_cmd.set_defaults(run=lambda args: print(message, file=sys.stderr) or 1)
    else:
        add_parsers(bench_sub)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="blink: %(message)s")
    try:
        return args.run(args)
    except USER_ERRORS as e:
        print(f"blink {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
