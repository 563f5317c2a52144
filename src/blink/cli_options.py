"""The ``blink`` command line's shared options: the engine's (model, device, memory, scheduler, ring sizes), the HTTP
agent's and the RDMA attachment's, each added to a subcommand's parser by one function (``blink.cli`` builds the
subcommands and runs them)."""
from __future__ import annotations

import argparse

from blink.host.priority import PRIORITIES


SERVED_GRAMMAR_BYTES = 64 << 20     # a served ring's grammars region: dozens of JSON schemas for a 50k vocabulary

# vLLM's --uvicorn-log-level names -> logging's levels (trace: aiohttp has nothing below debug)
LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
              "trace": "DEBUG"}


def model_options(parser, *, positional: bool) -> None:
    """The model and where its files are, by vLLM's option names (``blink.models.resolve_model``)."""
    if positional:
        parser.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    else:
        parser.set_defaults(model_path=None)
    parser.add_argument("--model", default=None, help="a model directory (HF layout) or a model id in the local "
                        "Hugging Face cache; default: the embedded SmolLM2")
    parser.add_argument("--revision", default="main",
                        help="with a model id: the branch, tag or commit of its snapshot in the cache")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="the Hugging Face hub cache that model ids are found in (default: $HF_HUB_CACHE, else "
                             "$HF_HOME/hub, else ~/.cache/huggingface/hub); blink reads it and never downloads")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines, and changes nothing: blink runs no code a checkpoint "
                             "brings (its model classes are its own, a tokenizer is read from tokenizer.json)")


def _cpu_list(text: str) -> list[int]:
    from blink.host.cores import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_options(parser, slots: int) -> None:
    """Model, device, memory, scheduler and ring sizes (``EngineConfig``, ``SchedulerConfig``)."""
    from blink.config import DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, EngineConfig, \
        SchedulerConfig, SpeculativeConfig
    from blink.device.config import MAX_BUCKETS

    d, s = EngineConfig(), SchedulerConfig()
    parser.add_argument("--device", choices=DEVICES, default=d.device, help="auto: the GPU if there is one")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                        help="dummy: random weights, only config.json is read (benchmarks of large shapes)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="default: the checkpoint's on a GPU, float32 on the CPU")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="fp8: FP8 projections, quantized at load")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                        help="auto: the model's dtype; fp8: e4m3 at scale 1, half the bytes a token")
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
    parser.add_argument("--speculative-config", type=SpeculativeConfig.from_json, default=None, metavar="JSON",
                        help="speculative decoding, vLLM's fields: '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5, "
                             "\"disable_by_batch_size\": 32}' (docs/scheduler.md, \"Speculative decoding\"); off by "
                             "default")
    parser.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                        help="split the model over this many processes (the CPU only, so far)")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from the memory options)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="share of the GPU's memory for weights, activations and the KV cache")
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=d.cpu_kv_cache_gib,
                        help="KV cache size on the CPU")
    parser.add_argument("--policy", default=None, metavar="MODULE:FUNCTION",
                        help="admission policy: a numba device function (docs/scheduler.md); default: first come, "
                             "first served")
    parser.add_argument("--slots", type=int, default=slots, help="ring request slots")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt a ring slot holds (default: max-model-len - 1)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="longest output a ring slot holds (default: max-model-len - 1)")
    parser.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="logit_bias tokens per request")
    parser.add_argument("--max-top-logprobs", type=int, default=d.max_top_logprobs, help="top_logprobs per token")
    parser.add_argument("--max-grammar-bytes", type=int, default=SERVED_GRAMMAR_BYTES,
                        help="ring bytes (and as many bytes of GPU memory) for the compiled grammars of structured "
                             "outputs (response_format, structured_outputs); 0: none, such requests get 400")


def http_options(parser) -> None:
    from blink.nic.agent_loop import LoopConfig
    from blink.nic.grammars import COMPILE_TIMEOUT_S
    from blink.nic.openai.tool_parsers import FORMATS

    parser.add_argument("--tokenizer", default=None,
                        help="the tokenizer's model directory or cached model id (default: the model's)")
    parser.add_argument("--tokenizer-revision", default="main", help="with a --tokenizer id: its revision")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the dir name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--max-queued", type=int, default=LoopConfig.max_queued,
                        help="requests that may wait in the agent for a free ring slot; beyond it: 429")
    parser.add_argument("--poll-interval", type=float, default=LoopConfig.poll_interval_s,
                        help="seconds the agent sleeps after a ring poll that found no tokens while requests are in "
                             "flight; 0: it polls without sleeping (a core busy while it serves, and no wake-up that "
                             "waits for a busy core; see docs/serving.md)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling seeds given to requests that bring none: a server started with the "
                             "same seed answers the same such requests, sent in the same order, with the same tokens "
                             "(default: random)")
    parser.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info",
                        help="level of the HTTP server's log (vLLM's name; blink's server is aiohttp's)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="accepted for vLLM's command lines: blink logs no request (nor its prompt) either way")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests (shown by ps: prefer "
                        "--api-key-file or $BLINK_API_KEY, read without either; default: no key)")
    parser.add_argument("--api-key-file", help="a file holding the API key (its text without surrounding whitespace)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template file, or the template itself (default: the model's chat_template.jinja "
                             "or tokenizer_config.json)")
    parser.add_argument("--tool-call-parser", choices=FORMATS, default=None,
                        help="the format the model writes tool calls in, read from its answers when a request's "
                             "tool_choice is auto (default: the one its chat template teaches, if known: <tool_call> "
                             "tags are hermes, a Llama 3 template llama3_json)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is served whenever the call format "
                             "is known (--tool-call-parser)")
    parser.add_argument("--generation-config", default="auto",
                        help="default sampling: auto (the model's generation_config.json), vllm (the OpenAI API's "
                             "defaults) or a directory holding a generation_config.json")
    parser.add_argument("--special-tokens-as-text", action="store_true",
                        help="encode special tokens' text inside chat messages as plain text (default: as the special "
                             "tokens, like transformers and vLLM; see docs/serving.md)")
    parser.add_argument("--grammar-timeout", type=float, default=COMPILE_TIMEOUT_S,
                        help="seconds one structured output (JSON schema, regex, choices) may take to compile; a "
                             "longer one gets 400")
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


def rdma_options(parser) -> None:
    parser.add_argument("--rdma-device", default=None, help="RDMA device (ibv_devices; default: the only one)")
    parser.add_argument("--rdma-port", type=int, default=1, help="RDMA device port")
    parser.add_argument("--rdma-gid-index", type=int, default=0,
                        help="GID table entry (show_gids; a RoCE v2 entry with the interface's address)")
