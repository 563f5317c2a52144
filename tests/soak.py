"""The soak: many mixed requests (streamed or not, chat or completions, stop strings, client cancellations, bad
input, over-limit lengths) through the HTTP server over an engine in another process, then every invariant.

Two engines: the stand-in (the reference consumer: fast, and its answers are known exactly) and the real CPU engine
with the embedded SmolLM2, whose every ``--slow-every``-th step is made ``--slow-s`` long on purpose
(``blink.faults``), longer than the agent's liveness timeout (``--liveness-timeout``): a long step must lose nothing.

Invariants checked at the end (``Soak.check``): every ring slot is FREE and back with the agent, nothing waits in
the agent, the ring's counters agree (finished == submitted, nothing running or waiting), every KV page is free or
evictable, the agent's finished-request counter equals the requests that reached the ring, its idle checks found
nothing (``blink_invariant_violations_total`` 0), no request got a 5xx, and every request got exactly one answer —
over the stand-in with exactly its model's tokens cut where a stop string or EOS says; over the CPU engine a whole
answer (a finish reason of stop or length, at most ``max_tokens`` tokens, exactly that many when EOS is ignored and
there is no stop string).

    python -m tests.soak --requests 100000 --json soak.json                 # the full stand-in soak
    python -m tests.soak --engine cpu --requests 10000 --json soak.json     # the full CPU-engine soak

``tests/test_soak.py`` runs short ones in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import aiohttp

from blink.config import EngineConfig
from blink.device.config import SchedulerConfig, SpeculativeConfig
from blink.faults import SLOW_STEPS
from blink.nic.agent import Agent
from blink.nic.agent_loop import LoopConfig
from blink.nic.openai.server import OpenAIServer, ServerConfig, start
from blink.nic.text import TextStream, Tokenizer
from blink.host.process import engine_process, wait_until_serving
from blink.ring.geometry import RingGeometry
from blink.ring.layout import FREE
from blink.ring.reference import expected_output, standin_engine
from blink.ring.request import SamplingParams

MODEL = "soak"
GEOMETRY = RingGeometry(n_slots=32, max_prompt_tokens=64, max_output_tokens=16, max_stop_ids=4, max_model_len=72)
KINDS = ("completion", "stream", "chat", "stop_string", "cancel", "bad_input", "over_limit")
WEIGHTS = (35, 25, 10, 10, 10, 5, 5)


@dataclass(frozen=True)
class CpuEngine:
    """The real CPU engine: every ``slow_every``-th model step sleeps ``slow_s`` (0: none), and the agent declares
    an engine dead after ``liveness_timeout_s`` without a beat; ``speculative``: its scheduler proposes and verifies
    n-gram drafts (``SpeculativeConfig``'s defaults)."""

    slow_every: int = 25
    slow_s: float = 1.5
    liveness_timeout_s: float = 1.0
    speculative: bool = False


@dataclass
class Soak:
    requests: int
    engine: CpuEngine | None = None                        # None: the stand-in
    seconds: float = 0.0
    steps: int = 0                                         # model steps the engine ran
    outcomes: Counter = field(default_factory=Counter)     # (kind, outcome) -> count
    wrong: list = field(default_factory=list)              # the first few wrong answers
    invariants: dict = field(default_factory=dict)
    speculation: dict = field(default_factory=dict)       # the ring's draft counters at the end

    def check(self) -> None:
        bad = {name: value for name, value in self.invariants.items() if value is not True}
        errors = {k: n for k, n in self.outcomes.items() if k[1] in ("5xx", "wrong", "exception")}
        answered = sum(self.outcomes.values())
        assert answered == self.requests, f"{self.requests - answered} requests got no answer"
        assert not errors and not bad, (errors, bad, self.wrong[:3])


@contextmanager
def serving(tokenizer: Tokenizer, engine: CpuEngine | None = None):
    """The HTTP server in this process (its own event-loop thread) over the engine in another."""
    with ExitStack() as stack:
        if engine is None:
            memory, process = stack.enter_context(standin_engine(GEOMETRY, vocab_size=tokenizer.vocab_size,
                                                                 eos_token_ids=tokenizer.eos_token_ids))
            agent = Agent(memory, GEOMETRY)
        else:
            memory, process = stack.enter_context(cpu_engine(engine))
            agent = Agent.attach(memory, liveness_timeout_s=engine.liveness_timeout_s)
        wait_until_serving(agent, process)
        server = OpenAIServer(agent, tokenizer, ServerConfig(model_name=MODEL, loop=LoopConfig(max_queued=4096)))
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        listening = asyncio.run_coroutine_threadsafe(start(server, "127.0.0.1", 0), loop).result()
        try:
            yield server, listening.port, loop
        finally:
            asyncio.run_coroutine_threadsafe(listening.cleanup(), loop).result()
            loop.call_soon_threadsafe(loop.stop)


@contextmanager
def cpu_engine(engine: CpuEngine):
    """The CPU engine (the embedded model) in a process of its own, on a ring of ``GEOMETRY``'s sizes, its steps
    slowed as ``engine`` says (the fault is read from the environment the engine process is spawned with)."""
    g = GEOMETRY
    config = EngineConfig(device="cpu", ring_name=f"blink-soak-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                          n_slots=g.n_slots, max_prompt_tokens=g.max_prompt_tokens,
                          max_output_tokens=g.max_output_tokens, max_stop_ids=g.max_stop_ids, sim_threads=2,
                          cpu_kv_cache_gib=0.1, scheduler=SchedulerConfig(
                              max_num_seqs=g.n_slots, max_num_batched_tokens=256, max_model_len=g.max_model_len,
                              speculative=SpeculativeConfig() if engine.speculative else None))
    with ExitStack() as stack:
        with environment(SLOW_STEPS, f"{engine.slow_every}:{engine.slow_s}"):
            memory, process = stack.enter_context(engine_process(config))      # spawned here
        yield memory, process


@contextmanager
def environment(name: str, value: str):
    """``os.environ[name]`` is ``value`` inside the block only."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


class Client:
    """Sends one request of a kind and says what became of it; what a served request must answer is computed
    from the stand-in model (``expected_output``) and the tokenizer, or over the CPU engine (whose tokens are not
    known here) checked to be whole (``whole``)."""

    def __init__(self, session: aiohttp.ClientSession, port: int, tokenizer: Tokenizer, soak: Soak):
        self.session, self.url, self.tokenizer, self.soak = session, f"http://127.0.0.1:{port}/v1", tokenizer, soak

    async def one(self, kind: str, rng: random.Random) -> str:
        prompt = [rng.randrange(self.tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), seed=rng.randrange(2**32), temperature=0.7,
                                ignore_eos=rng.random() < 0.5)
        standin = self.soak.engine is None
        tokens = self._expected(prompt, params) if standin else []
        body = {"model": MODEL, "prompt": prompt, "max_tokens": params.max_tokens, "seed": params.seed,
                "temperature": params.temperature, "ignore_eos": params.ignore_eos}
        stop = ()
        if kind == "chat":
            messages = [{"role": "user", "content": f"question {rng.randrange(10**6)}"}]
            tokens = self._expected(self.tokenizer.encode_chat(messages), params) if standin else []
            body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": messages}
        elif kind == "stop_string":
            text = self.tokenizer.decode(tokens) if standin else "e"    # the real model's text has many an "e"
            stop = (text[len(text) // 2:][:2],) if len(text) >= 4 else (text or "\x00",)
            body["stop"] = list(stop)
        elif kind == "bad_input":
            body[rng.choice(["top_k", "priority", "max_tokens", "temperature"])] = rng.choice([2**31, -5, 1e308, 2**64])
        elif kind == "over_limit":          # fits the slot (64 prompt tokens) but not max_model_len (72)
            body["prompt"], body["max_tokens"] = prompt[:1] + [1] * (GEOMETRY.max_prompt_tokens - 4), 16
        path = "/chat/completions" if kind == "chat" else "/completions"
        stream = kind in ("stream", "cancel") or rng.random() < 0.3
        want = self._text(tokens, stop)
        async with self.session.post(self.url + path, json={**body, "stream": stream}) as response:
            if response.status >= 500:
                return "5xx"
            if response.status >= 400:
                return "4xx" if kind in ("bad_input", "over_limit") else self._wrong(kind, body, response.status)
            if kind == "cancel":
                await response.content.readline()       # the first event, then the client goes away
                response.close()
                return "cancelled"
            got, finish, n = await (self._streamed(response, kind) if stream else self._whole(response, kind))
            ok = got == want if standin else whole(finish, n, params, stop)
            return "ok" if ok else self._wrong(kind, body, (got, finish, n, want if standin else None, stream,
                                                            None if stream else self.last_body))

    def _expected(self, prompt: list[int], params: SamplingParams) -> list[int]:
        return expected_output(prompt, params, self.tokenizer.eos_token_ids, self.tokenizer.vocab_size)[0]

    def _text(self, tokens: list[int], stop) -> str:
        text = TextStream(self.tokenizer, stop)
        return "".join(text.push(t) for t in tokens) + text.finish()

    async def _whole(self, response, kind: str) -> tuple[str, str, int]:
        """The answer's text, finish reason and token count."""
        body = await response.json()
        choice = body["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        self.last_body = body
        return text, choice["finish_reason"], body["usage"]["completion_tokens"]

    async def _streamed(self, response, kind: str) -> tuple[str, str | None, None]:
        """The streamed answer's text and finish reason (an error event fails the request: it has no choices)."""
        text, finish = "", None
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content", "") if kind == "chat" else choice["text"]
                finish = choice["finish_reason"] or finish
        return text, finish, None

    def _wrong(self, kind, body, what) -> str:
        if len(self.soak.wrong) < 10:
            self.soak.wrong.append((kind, body, what))
        return "wrong"


def whole(finish: str | None, n: int | None, params: SamplingParams, stop) -> bool:
    """An answer of the CPU engine is whole: it ended by stop or length, with at most ``max_tokens`` tokens, all of
    them when neither EOS nor a stop string may end it early (``n`` None: a stream, whose count is not sent)."""
    exact = params.ignore_eos and not stop
    if finish not in ("stop", "length") or (exact and finish != "length"):
        return False
    return n is None or (n == params.max_tokens if exact else n <= params.max_tokens)


async def drive(port: int, tokenizer: Tokenizer, soak: Soak, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    plan = rng.choices(KINDS, WEIGHTS, k=soak.requests)
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    # Over the CPU engine a request may wait minutes for a slot on a loaded host: it fails only once nothing has
    # arrived for 10 minutes (a request lost in the server), not after a fixed total.
    timeout = aiohttp.ClientTimeout(total=60) if soak.engine is None else aiohttp.ClientTimeout(sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = Client(session, port, tokenizer, soak)

        async def run(i: int, kind: str) -> None:
            async with semaphore:
                try:
                    outcome = await client.one(kind, random.Random(seed * 1_000_003 + i))
                except Exception as e:          # a reset, a timeout: the soak counts it as a failure
                    outcome = "exception"
                    client._wrong(kind, i, repr(e))
                soak.outcomes[(kind, outcome)] += 1

        await asyncio.gather(*(run(i, kind) for i, kind in enumerate(plan)))


def invariants(server: OpenAIServer, loop, soak: Soak) -> dict:
    """Once the ring has drained: what must hold whatever the requests were."""
    def on_loop(fn):
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), loop).result()

    agent = server.loop.agent
    deadline = time.monotonic() + 30
    while on_loop(lambda: agent.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Then long enough for the engine's gauges to settle and the agent's idle checks to judge (blink.nic.invariants).
    drained, settled = agent.stats()["heartbeat"], time.monotonic() + 5 * server.loop.HEARTBEAT_SAMPLE_S
    while (agent.stats()["heartbeat"] < drained + 3 or time.monotonic() < settled) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = agent.stats()
    soak.steps = stats["steps"]
    soak.speculation = {name: int(stats[name]) for name in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")}
    states = on_loop(lambda: agent._snapshot()[1]["state"].copy())
    finished = sum(server.metrics.requests.labels(finish_reason=r)._value.get()
                   for r in ("stop", "length", "abort", "error"))
    reached = sum(n for (kind, outcome), n in soak.outcomes.items() if outcome in ("ok", "cancelled", "wrong"))
    return {
        "every slot back with the agent": on_loop(lambda: agent.in_flight == 0
                                                  and agent.tracker.n_free == GEOMETRY.n_slots),
        "every slot FREE in the ring": bool((states == FREE).all()),
        "nothing waits in the agent": on_loop(lambda: not server.loop.waiting and not server.loop._active),
        "ring counters agree": stats["finished"] == stats["submitted"] and stats["running"] == stats["waiting"] == 0,
        "every KV page free or evictable": stats["kv_pages_free"] == stats["kv_pages_total"],
        "each reached request finished once": int(finished) == reached,
        "no idle invariant violation": server.metrics.invariant_violations._value.get() == 0,
    }


def run(requests: int, concurrency: int = 64, seed: int = 0, engine: CpuEngine | None = None) -> Soak:
    """``requests`` mixed requests, ``concurrency`` at a time, over the stand-in (``engine`` None) or the CPU
    engine."""
    from blink.models import default_model_path

    tokenizer = Tokenizer(default_model_path())
    soak = Soak(requests, engine)
    with serving(tokenizer, engine) as (server, port, loop):
        start_time = time.monotonic()
        asyncio.run(drive(port, tokenizer, soak, concurrency, seed))
        soak.seconds = time.monotonic() - start_time
        soak.invariants = invariants(server, loop, soak)
    return soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--engine", choices=("standin", "cpu"), default="standin",
                        help="the stand-in (answers known exactly) or the CPU engine with the embedded model")
    defaults = CpuEngine()
    parser.add_argument("--slow-every", type=int, default=defaults.slow_every,
                        help="CPU engine: every this many model steps one is made long on purpose (0: none)")
    parser.add_argument("--slow-s", type=float, default=defaults.slow_s, help="CPU engine: how long, in seconds")
    parser.add_argument("--liveness-timeout", type=float, default=defaults.liveness_timeout_s,
                        help="CPU engine: the agent's liveness timeout, in seconds")
    parser.add_argument("--speculative", action="store_true", help="CPU engine: speculative decoding on")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    engine = (CpuEngine(args.slow_every, args.slow_s, args.liveness_timeout, args.speculative)
              if args.engine == "cpu" else None)
    soak = run(args.requests, args.concurrency, args.seed, engine)
    outcomes = {f"{kind} {outcome}": n for (kind, outcome), n in sorted(soak.outcomes.items())}
    print(f"{soak.requests} requests in {soak.seconds:.1f} s ({soak.requests / soak.seconds:.0f} req/s), "
          f"concurrency {args.concurrency}, {soak.steps} model steps, speculation {soak.speculation}")
    for name, n in outcomes.items():
        print(f"  {name:<24} {n:8d}")
    for name, ok in soak.invariants.items():
        print(f"  invariant: {name}: {'holds' if ok is True else 'BROKEN'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": soak.requests, "seconds": soak.seconds, "concurrency": args.concurrency,
                       "seed": args.seed, "engine": args.engine, "cpu_engine": engine and engine.__dict__,
                       "steps": soak.steps, "speculation": soak.speculation, "outcomes": outcomes,
                       "invariants": soak.invariants,
                       "wrong": [repr(w) for w in soak.wrong]}, f, indent=1)
    soak.check()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
