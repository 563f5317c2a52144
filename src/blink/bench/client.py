"""An OpenAI-compatible server as a benchmark backend: streamed ``/v1/completions``, the arrival time of each chunk.

The request is what ``vllm bench serve`` sends for ``--backend openai``: the prompt (token ids here), ``max_tokens``,
greedy sampling, ``stream`` with ``include_usage`` (the output token count comes from ``usage.completion_tokens``;
a server that sends no usage is counted one token per chunk) and, with ``ignore_eos``, the vLLM extension of that name.
"""
from __future__ import annotations

import json
import re
import time

import aiohttp

from blink.bench.datasets import SampleRequest
from blink.bench.metrics import RequestOutput
from blink.bench.process_cpu import tree_cpu_seconds

# The server's CPU time so far: prometheus_client's process collector (blink's agent and vLLM's API server have it),
# or the server's processes' (``OpenAIClient``'s ``server_pid``).
CPU_COUNTER = "process_cpu_seconds_total"
# blink's own time to first token: from a request's submission to the ring to its first token (the histogram's total
# and count), the part of the client's TTFT that the HTTP path and the client do not add to.
SERVER_TTFT = ("blink_time_to_first_token_seconds_sum", "blink_time_to_first_token_seconds_count")
# blink's HTTP server's time to first token: from a streamed request's arrival to its first chunk written, so the
# client's TTFT less this is the network's and the client's own share.
SERVER_HTTP_TTFT = ("blink_http_time_to_first_chunk_seconds_sum", "blink_http_time_to_first_chunk_seconds_count")
# Tokens computed per model step, from blink's step and token counters, or vLLM's histogram of the tokens each engine
# step scheduled: at a given arrival rate, fewer tokens per step means more steps (each reading every weight) per token.
BLINK_STEP_TOKENS = ("blink_engine_steps_total", "blink_generation_tokens_total", "blink_prefill_tokens_total")
VLLM_STEP_TOKENS = ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum")
# blink's agent pausing: its stalls (ring polls far apart with requests in flight: how many, their time, the part
# off the CPU) and its GC passes (time, count; all generations).
AGENT_PAUSES = ("blink_agent_stalls_total", "blink_agent_stall_seconds_total",
                "blink_agent_stall_off_cpu_seconds_total", "blink_agent_gc_pause_seconds_sum",
                "blink_agent_gc_pause_seconds_count")
# ... and how long its event loop's thread waited for a core (runnable, not running; where Linux counts it).
AGENT_RUN_DELAY = "blink_agent_run_delay_seconds_total"
# ... and how long a hypervisor ran something else on the cores that thread may use (steal).
AGENT_STEAL = "blink_agent_cores_steal_seconds_total"
# Speculative decoding's drafts verified and accepted, under vLLM's names (blink exports them too): sequence steps
# that verified drafts, draft tokens, accepted ones; and the accepted ones by draft position (its ``position`` label:
# recorded as ``NAME[position]``).
SPEC_DECODE = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
               "vllm:spec_decode_num_accepted_tokens_total")
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# The server's counters a run records, as their change over the run (blink's /metrics; another server has fewer).
SERVER_COUNTERS = ("blink_prefix_cache_queries_total", "blink_prefix_cache_hits_total",
                   "blink_prefix_cache_evictions_total", CPU_COUNTER, *SERVER_TTFT, *SERVER_HTTP_TTFT,
                   *BLINK_STEP_TOKENS, *VLLM_STEP_TOKENS, *AGENT_PAUSES, AGENT_RUN_DELAY, AGENT_STEAL, *SPEC_DECODE,
                   SPEC_PER_POS)
# Seconds an idle connection is kept for reuse: less than any server's own keep-alive (blink's keepalive_timeout_s,
# uvicorn's 5 s under vLLM): reusing a connection the server is closing fails the request with ServerDisconnectedError.
KEEPALIVE_S = 2.0


def parse_counters(text: str) -> dict[str, float]:
    """The ``SERVER_COUNTERS`` in a Prometheus text exposition, each summed over its label sets (vLLM labels its
    metrics with the model's name: ``vllm:iteration_tokens_total_sum{model_name="m"} 8.0``), but ``SPEC_PER_POS``'s
    kept apart by position (``NAME[0]``, ``NAME[1]``, ...)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name == SPEC_PER_POS:
            name += "[{}]".format(re.search(r'position="(\d+)"', series).group(1))
        elif name not in SERVER_COUNTERS:
            continue
        values[name] = values.get(name, 0.0) + float(value)
    return values


def histogram_mean_ms(server: dict | None, histogram: tuple[str, str]) -> float | None:
    """The mean of a server's latency histogram (``SERVER_TTFT``, ``SERVER_HTTP_TTFT``: its sum and count) over a
    run (``server``: the counters' changes), in ms; None where the server does not tell it."""
    total, count = ((server or {}).get(name) for name in histogram)
    return total / count * 1e3 if count else None


def tokens_per_step(server: dict | None) -> float | None:
    """Mean tokens a model step computed over a run (``server``: the counters' changes), None where not told."""
    server = server or {}
    steps, *tokens = (server.get(name) for name in BLINK_STEP_TOKENS)
    if steps and None not in tokens:
        return sum(tokens) / steps
    count, total = (server.get(name) for name in VLLM_STEP_TOKENS)
    return total / count if count and total is not None else None


def server_notes(server: dict | None) -> str | None:
    """What the server says about a run beyond its latencies (``server``: the counters' changes), in words: blink's
    agent pausing, speculative decoding's acceptance; None where it tells neither."""
    notes = [note for note in (agent_pauses(server), speculation(server)) if note]
    return "; ".join(notes) or None


def speculation(server: dict | None) -> str | None:
    """Draft tokens verified and accepted over a run, the mean tokens a verifying step made per sequence (vLLM's
    mean acceptance length: 1 + accepted / steps) and, where the server tells it, the share of those steps that
    kept each draft position; None where the server verified none."""
    server = server or {}
    steps, drafts, accepted = (server.get(name) for name in SPEC_DECODE)
    if not drafts or accepted is None:
        return None
    note = f"speculation: {accepted:.0f} of {drafts:.0f} draft tokens accepted ({accepted / drafts:.0%})"
    if steps:
        note += f", mean acceptance length {1 + accepted / steps:.2f}"
        kept = []
        while f"{SPEC_PER_POS}[{len(kept)}]" in server:
            kept.append(server[f"{SPEC_PER_POS}[{len(kept)}]"])
        if kept:
            note += ", draft 1, 2, ... kept in " + ", ".join(f"{count / steps:.0%}" for count in kept)
    return note


def agent_pauses(server: dict | None) -> str | None:
    """blink's agent pausing over a run (``server``: the counters' changes) in words, None where not told."""
    values = [(server or {}).get(name) for name in AGENT_PAUSES]
    if None in values:
        return None
    stalls, stall_s, off_cpu_s, gc_s, gc_passes = values
    waited_s, steal_s = ((server or {}).get(name) for name in (AGENT_RUN_DELAY, AGENT_STEAL))
    return (f"agent stalls {stalls:.0f} ({stall_s * 1e3:.1f} ms, {off_cpu_s * 1e3:.1f} ms of it off the CPU), "
            f"GC {gc_s * 1e3:.1f} ms in {gc_passes:.0f} passes"
            + (f", waits for a core {waited_s * 1e3:.1f} ms" if waited_s is not None else "")
            + (f", its cores' steal {steal_s * 1e3:.1f} ms" if steal_s is not None else ""))


class OpenAIClient:
    """``async with OpenAIClient(base_url) as client: await client.send(request)``. ``model=None`` asks the server
    (the first entry of ``GET /v1/models``, as vLLM does). With ``server_pid`` the server's CPU time
    (``CPU_COUNTER``) is that process's and its descendants' (``process_cpu``), not what its /metrics says."""

    def __init__(self, base_url: str, model: str | None = None, ignore_eos: bool = False,
                 response_format: dict | None = None, server_pid: int | None = None):
        self.base_url = base_url.rstrip("/")
        self.model, self.ignore_eos, self.response_format = model, ignore_eos, response_format
        self.server_pid = server_pid
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        # No connection limit: the benchmark's --max-concurrency is the only cap on requests in flight.
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600),
                                             connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
        if self.model is None:
            self.model = await self.first_model()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def first_model(self) -> str:
        url = f"{self.base_url}/v1/models"
        try:
            async with self.session.get(url) as response:
                response.raise_for_status()
                models = (await response.json())["data"]
        except (aiohttp.ClientError, KeyError, ValueError) as e:
            raise ValueError(f"could not list the models at {url} ({e}): is the server running there? "
                             "--base-url is the server's root, without /v1") from None
        if not models:
            raise ValueError(f"{url} lists no model: pass --model")
        return models[0]["id"]

    def info(self) -> dict:
        return {"base_url": self.base_url, "model": self.model, "response_format": self.response_format}

    async def server_counters(self) -> dict[str, float] | None:
        """The ``SERVER_COUNTERS`` on the server's /metrics now, ``CPU_COUNTER`` from its processes with
        ``server_pid``; None if it has none of them (or no /metrics, and no ``server_pid``)."""
        try:
            async with self.session.get(f"{self.base_url}/metrics") as response:
                text = await response.text() if response.status == 200 else ""
        except aiohttp.ClientError:
            text = ""
        counters = parse_counters(text)
        if self.server_pid is not None:
            counters[CPU_COUNTER] = tree_cpu_seconds(self.server_pid)
        return counters or None

    def payload(self, request: SampleRequest) -> dict:
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.response_format is not None:
            body["response_format"] = self.response_format
        return body

    async def send(self, request: SampleRequest) -> RequestOutput:
        """One request, streamed; never raises: what went wrong is the output's ``error``."""
        out = RequestOutput(request.prompt_len, start=time.perf_counter())
        try:
            async with self.session.post(f"{self.base_url}/v1/completions", json=self.payload(request)) as response:
                if response.status != 200:
                    out.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                    return out
                async for line in response.content:
                    self._on_event(out, line.strip())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:     # ValueError: a malformed event
            out.error = f"{type(e).__name__}: {e}"
        if out.error is None and not out.chunk_times:
            out.error = "the stream ended without a token"
        if out.error is None and not out.output_tokens:
            out.output_tokens = len(out.chunk_times)
        return out

    @staticmethod
    def _on_event(out: RequestOutput, line: bytes) -> None:
        """One SSE line: a chunk with choices is a token arrival; ``usage`` gives the count; ``error`` fails it."""
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return
        chunk = json.loads(line[5:])
        if chunk.get("choices"):
            out.chunk_times.append(time.perf_counter())
        if chunk.get("usage"):
            out.output_tokens = chunk["usage"]["completion_tokens"]
        if "error" in chunk:
            out.error = f"error in the stream: {chunk['error'].get('message', chunk['error'])}"
