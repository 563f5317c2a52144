"""``blink`` command line: the subcommands and thin commands over ``blink.host.process`` (engine processes),
``blink.engine`` (in-process generation) and ``blink.nic.openai`` (the HTTP agent); the options they share are in
``blink.cli_options``."""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import uuid

from blink.cli_options import LOG_LEVELS, engine_options, http_options, model_options, rdma_options
from blink.host.agents import CORES_PER_AGENT_PROCESS, default_agent_processes
from blink.host.process import USER_ERRORS, report_stacks_on_sigusr1
from blink.ring.shares import Share
from blink.ring.split import REQUEST_SIDES

_ring_numbers = itertools.count()
log = logging.getLogger("blink")


def ring_demo(args) -> int:
    from blink.demo import ring_demo

    return ring_demo(args.slots, args.requests, args.max_tokens, args.seed)


def serve(args) -> int:
    """The engine in another process and the agent's HTTP server in this one, over a shared-memory ring; or, with
    ``--agent-processes N`` > 1, in N processes that this one supervises (``blink.host.agents``)."""
    from blink.host.process import engine_process, split_cores
    from blink.ring.reference import standin_engine

    configs = _agent_configs(args)      # checked before the engine starts
    agents = _agent_processes(args)
    Share(0, agents).slots(args.slots)
    model_dir = _model_dir(args)
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
    with engine as (memory, process), split_cores(process, args.cpus, args.reserve_agent_cores, agents) as cores:
        if agents == 1:
            return _serve_http(args, configs, memory, tokenizer, model_dir, process, cores)
        return _serve_agents(args, configs, memory, process, cores, agents)


def _agent_processes(args) -> int:
    """``--agent-processes``, or its default from the cores this process may use (logged either way)."""
    if args.agent_processes is not None:
        if not args.agent_processes >= 1:
            raise ValueError(f"--agent-processes must be 1 or more (got {args.agent_processes})")
        log.info("%d agent process%s (--agent-processes)", args.agent_processes,
                 "es" if args.agent_processes > 1 else "")
        return args.agent_processes
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    agents = default_agent_processes(cores, args.slots)
    log.info("%d agent process%s: one per %d of the %d cores this process may use (--agent-processes N to choose)",
             agents, "es" if agents > 1 else "", CORES_PER_AGENT_PROCESS, cores)
    return agents


def _serve_agents(args, configs, memory, engine_process, cores, agents) -> int:
    """``--agent-processes N`` > 1: N agent processes serve ``memory``'s ring on one port (``blink.host.agents``),
    agent process ``i`` on agent core ``i`` (modulo their number)."""
    from functools import partial

    from blink.host.agents import supervise
    from blink.nic.metrics import shared_metrics
    from blink.nic.openai.ports import reserve_port
    from blink.ring import control

    with reserve_port(args.host, args.port) as held, shared_metrics() as exited:
        on_port = argparse.Namespace(**{**vars(args), "port": held.getsockname()[1]})     # port 0: the one chosen
        target = partial(_agent_process, on_port, configs, memory.name, control.read(memory)["prefix_seed"],
                         engine_process.pid, cores)
        return supervise(target, agents, engine_process, exited)


def _agent_process(args, configs, ring: str, prefix_seed: int, engine_pid: int, cores, share, listening) -> int:
    """One of ``blink serve``'s agent processes: its ``share`` of the ring ``ring`` (the server's, ``prefix_seed``
    says) over HTTP until it drains or the engine process ``engine_pid`` is gone."""
    from blink.host.agents import Sibling, reopen_ring

    model_dir = _model_dir(args)
    with reopen_ring(ring, prefix_seed) as memory:
        return _serve_http(args, configs, memory, _tokenizer(args, model_dir), model_dir, Sibling(engine_pid),
                           cores and [cores[share.index % len(cores)]], share, listening)


def engine(args) -> int:
    """The engine on a new shared-memory ring until Ctrl-C or SIGTERM; ``blink agent --ring NAME`` serves HTTP on it."""
    from blink.host.process import serve_ring

    serve_ring(_engine_config(args, _model_dir(args), ring_name=args.ring,
                              request_side=args.request_side),
               listen=args.listen, rdma_device=_rdma_device(args))
    return 0


def generate(args) -> int:
    """One prompt through an in-process engine; the text streams to stdout."""
    from blink.engine import Engine
    from blink.ring.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    with Engine(_engine_config(args, _model_dir(args))) as llm:
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
    from blink.host.process import split_cores

    if args.ring_key is not None and args.remote is None:
        raise ValueError("--ring-key NAME goes with --remote (--ring NAME reads the key file of NAME itself)")
    configs = _agent_configs(args)
    model_dir = _model_dir(args)
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
        from blink.host.process import open_ring

        return open_ring(args.ring)
    from blink.nic.remote.attach import open_remote
    from blink.ring import secret

    return open_remote(args.remote, args.transport, ring_secret=secret.given(args.ring_key),
                       device=_rdma_device(args))


def _rdma_device(args):
    from blink.nic.remote.ibverbs import DeviceConfig

    return DeviceConfig(device=args.rdma_device, port=args.rdma_port, gid_index=args.rdma_gid_index)


def _serve_http(args, configs, memory, tokenizer, model_dir, engine_process, cores, share=Share(),
                listening=lambda: None) -> int:
    """The HTTP agent on ``memory``'s ring, or its ``share`` of it beside other agent processes, until Ctrl-C /
    SIGTERM (exit 0) or until its engine is gone (exit 1: the engine is not restarted here; a supervisor restarts the
    whole server). What the server may hold at once is split among the agent processes (``Share.cap``)."""
    from dataclasses import replace

    from blink.nic.agent import Agent
    from blink.nic.defaults import sampling_defaults
    from blink.nic.openai.api_key import api_key_from
    from blink.nic.openai.limits import HttpLimits
    from blink.nic.openai.server import OpenAIServer, ServerConfig, run
    from blink.host.priority import helper_priority, pin, set_priority
    from blink.host.process import engine_watch

    set_priority(args.agent_priority)           # before any thread starts: threads inherit it
    if cores:
        pin(cores, named=bool(args.cpus))       # keep the agent off the engine's cores
    for server_log in ("aiohttp", "blink.server"):
        logging.getLogger(server_log).setLevel(LOG_LEVELS[args.uvicorn_log_level])
    # Each agent process draws the seeds of unseeded requests from its own start (--seed N: N × agents + index).
    seed = None if args.seed is None else args.seed * share.agents + share.index
    agent = Agent.attach(memory, share, liveness_timeout_s=args.liveness_timeout, seed=seed)
    if share.agents > 1:
        log.info("slots %d-%d of the ring's %d", agent.slots.start, agent.slots.stop - 1, agent.geometry.n_slots)
    loop, drain = configs
    config = ServerConfig(model_name=args.served_model_name or os.path.basename(model_dir),
                          loop=replace(loop, max_queued=share.cap(loop.max_queued)),
                          limits=HttpLimits().per_process(share), api_key=api_key_from(args.api_key, args.api_key_file),
                          defaults=sampling_defaults(model_dir, args.generation_config), drain=drain,
                          thread_start=helper_priority, grammar_timeout_s=args.grammar_timeout,
                          tool_call_parser=args.tool_call_parser)
    # Listening while the engine starts: /livez 200, /readyz 503 "starting" (docs/deploy.md).
    server = OpenAIServer(agent, tokenizer, config, engine_gone=engine_watch(agent, engine_process))
    return run(server, args.host, args.port, reuse_port=share.agents > 1, listening=listening)


def _tokenizer(args, model_dir):
    from blink.nic.text import Tokenizer, chat_template_argument

    if args.tokenizer is not None:
        from blink.models import resolve_model

        model_dir = resolve_model(args.tokenizer, args.tokenizer_revision, args.download_dir)
    return Tokenizer(model_dir, chat_template=chat_template_argument(args.chat_template),
                     special_tokens_in_content=not args.special_tokens_as_text)


def _ring_name() -> str:
    """A fresh shared-memory name: the pid alone repeats (PID 1 in every container), a random part does not."""
    return f"blink-{os.getpid()}-{next(_ring_numbers)}-{uuid.uuid4().hex[:8]}"


def _model_dir(args):
    from blink.models import resolve_model

    return resolve_model(args.model_path or args.model, args.revision, args.download_dir)


def _engine_config(args, model_dir, **overrides):
    from blink.config import EngineConfig, SchedulerConfig

    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                page_size=args.block_size, num_pages=args.num_pages,
                                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                                speculative=args.speculative_config,
                                buckets=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None)
    same = ("device", "dtype", "policy", "gpu_memory_utilization", "cpu_kv_cache_gib", "max_prompt_tokens",
            "max_output_tokens", "max_logit_bias", "max_top_logprobs", "quantization", "kv_cache_dtype",
            "load_format", "tensor_parallel_size", "max_grammar_bytes")
    return EngineConfig(model=str(model_dir), scheduler=scheduler, n_slots=args.slots,
                        **{name: getattr(args, name) for name in same}, **overrides)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):     # no "(default: None)": such an option's help says what its absence does
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blink", description=__doc__, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, run, help):
        p = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        p.set_defaults(run=run)
        return p

    demo = command("ring-demo", ring_demo, "agent and reference consumer in two processes over shared memory")
    demo.add_argument("--requests", type=int, default=5000, help="requests to send")
    demo.add_argument("--slots", type=int, default=1024, help="ring request slots")
    demo.add_argument("--max-tokens", type=int, default=32, help="longest output")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    serve_cmd = command("serve", serve, "engine + OpenAI-compatible HTTP server (agent) over a shared ring")
    model_options(serve_cmd, positional=True)
    http_options(serve_cmd)
    engine_options(serve_cmd, slots=256)
    serve_cmd.add_argument("--agent-processes", type=int, default=None, metavar="N",
                           help="agent processes serving the ring together on one port, each its own share of the "
                                "ring's slots (the kernel spreads the connections; docs/serving.md); default: one "
                                f"per {CORES_PER_AGENT_PROCESS} cores this process may use, at least 1")
    serve_cmd.add_argument("--standin", action="store_true",
                           help="run the reference consumer with the stand-in model as the engine")
    serve_cmd.add_argument("--standin-step-ms", type=float, default=0.0,
                           help="with --standin: the least time between its steps, as a GPU's decode step (0: no "
                                "pause; benchmarks of the agent use ~10)")
    engine_cmd = command("engine", engine, "the engine alone, on a new shared-memory ring (see: blink agent)")
    model_options(engine_cmd, positional=True)
    engine_cmd.add_argument("--ring", required=True, help="name of the ring to create (/dev/shm/NAME)")
    engine_cmd.add_argument("--listen", default=None, metavar="HOST:PORT",
                            help="also let agents on other hosts or DPUs attach here (docs/dpu.md)")
    engine_cmd.add_argument("--request-side", choices=REQUEST_SIDES, default=REQUEST_SIDES[0],
                            help="where the ring's request side lives: host memory, or GPU memory (a GPU engine with "
                                 "--listen: agents attach only through the listener, a NIC writes it directly)")
    rdma_options(engine_cmd)
    engine_options(engine_cmd, slots=256)
    gen_cmd = command("generate", generate, "generate from one prompt with an in-process engine")
    gen_cmd.add_argument("prompt", help="the prompt text")
    model_options(gen_cmd, positional=False)
    gen_cmd.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen_cmd.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen_cmd.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen_cmd.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen_cmd.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    gen_cmd.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    gen_cmd.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    engine_options(gen_cmd, slots=4)
    agent_cmd = command("agent", agent, "OpenAI-compatible HTTP server on the ring of a running engine")
    model_options(agent_cmd, positional=False)
    http_options(agent_cmd)
    where = agent_cmd.add_mutually_exclusive_group(required=True)
    where.add_argument("--ring", default=None, help="the engine's shared-memory ring name (/dev/shm/NAME)")
    where.add_argument("--remote", default=None, metavar="HOST:PORT",
                       help="the engine's --listen address: attach over --transport")
    agent_cmd.add_argument("--transport", choices=("rdma", "ipc"), default="rdma",
                           help="with --remote: RDMA (a DPU or another host) or CUDA IPC (the same host)")
    agent_cmd.add_argument("--ring-key", default=None, metavar="NAME",
                           help="with --remote on the engine's host: prove the secret in the key file of its ring "
                                "NAME (/dev/shm/NAME.key); $BLINK_RING_SECRET, if set, is taken instead")
    rdma_options(agent_cmd)
    bench_cmd = sub.add_parser("bench", help="benchmarks: serve (online serving, vllm bench serve's metrics), report")
    bench_cmd.set_defaults(run=None)
    bench_sub = bench_cmd.add_subparsers(dest="bench_command", required=True)
    try:
        from blink.bench.serve import add_parsers
    except ImportError as e:            # the bench extra is not installed
        message = f"blink bench needs the bench extra ({e.name} is missing): pip install 'blink-serve[bench]'"
        bench_cmd.set_defaults(run=lambda args: print(message, file=sys.stderr) or 1)
    else:
        add_parsers(bench_sub)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="blink: %(message)s")
    report_stacks_on_sigusr1()
    try:
        return args.run(args)
    except USER_ERRORS as e:
        print(f"blink {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
