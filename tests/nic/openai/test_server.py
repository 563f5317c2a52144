"""blink.nic.server end to end: the official openai client -> HTTP -> agent -> shared-memory ring -> the real CPU
engine (``blink engine``: simulated GPU scheduler + SmolLM2 on torch) in another process, and back. Expected outputs
come from an in-process ``Engine`` given the same prompts and seeds (seeded sampling does not depend on the batch),
their text decoded by transformers' tokenizer. Pausing the engine process (SIGSTOP) plays a stalled GPU. Input
validation runs against the stand-in engine (the reference consumer), where no model step is needed."""
import asyncio
import http.client
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from blink import Engine, EngineConfig, EngineError, SamplingParams, SchedulerConfig
from blink.nic.agent import Agent
from blink.nic.agent_loop import LoopConfig
from blink.nic.liveness import TICK_FLOOR_S
from blink.nic.openai.api_key import api_key_from
from blink.nic.openai.server import OpenAIServer, ServerConfig, start
from blink.nic.text import Tokenizer
from blink.host.process import engine_process, wait_until_serving
from blink.ring.layout import FREE, RUNNING
from blink.ring.reference import standin_engine
from tests.processes import children

MODEL = "smollm2-test"
ENGINE = EngineConfig(device="cpu", n_slots=8, max_prompt_tokens=256, max_output_tokens=32, max_stop_ids=4,
                      max_logit_bias=4, max_top_logprobs=5,
                      scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=288),
                      cpu_kv_cache_gib=0.25, sim_threads=2)
GEOMETRY = ENGINE.geometry(ENGINE.scheduler.max_model_len)
CONFIG = ServerConfig(model_name=MODEL, loop=LoopConfig(max_queued=16))
LIVENESS_TIMEOUT_S = 3.0     # the agent's; generous: this 2-core box may run other test sessions too


@dataclass
class Served:
    server: OpenAIServer
    agent: Agent
    engine: object          # the engine's multiprocessing.Process
    port: int
    loop: asyncio.AbstractEventLoop

    def client(self, cls=openai.OpenAI):
        return cls(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0)

    def on_loop(self, fn):
        """Run ``fn()`` on the server's event loop thread (the agent is not thread-safe)."""
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    @contextmanager
    def paused_engine(self):
        os.kill(self.engine.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.engine.pid, signal.SIGCONT)

    def wait_idle(self, timeout_s=30.0):
        """Until every slot is back with the agent; returns the ring's stats."""
        wait_for(lambda: self.on_loop(lambda: self.agent.in_flight == 0), timeout_s)
        return self.agent.stats()


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def model_dir():
    from blink.models import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@contextmanager
def serving(engine, tokenizer, config=CONFIG, attach=lambda memory: Agent(memory, GEOMETRY,
                                                                         liveness_timeout_s=LIVENESS_TIMEOUT_S)):
    """The HTTP server (``config``) on a background event loop, over the ring of ``engine`` (a context giving
    memory, process), through the agent ``attach(memory)`` makes."""
    with engine as (memory, process):
        agent = attach(memory)
        wait_until_serving(agent, process)
        server = OpenAIServer(agent, tokenizer, config)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        listening = asyncio.run_coroutine_threadsafe(start(server, "127.0.0.1", 0), loop).result()
        yield Served(server, agent, process, listening.port, loop)
        asyncio.run_coroutine_threadsafe(listening.cleanup(), loop).result()
        if server.grammars is not None:
            server.grammars.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


@pytest.fixture(scope="module")
def served(model_dir):
    config = replace(ENGINE, model=str(model_dir), ring_name=f"blink-test-{os.getpid()}")
    with serving(engine_process(config), Tokenizer(model_dir)) as served:
        yield served


@pytest.fixture(scope="module")
def standin_served(model_dir):
    """The server over the stand-in engine: for input validation, where what the model says does not matter."""
    tokenizer = Tokenizer(model_dir)
    with serving(standin_engine(GEOMETRY, vocab_size=tokenizer.vocab_size,
                                eos_token_ids=tokenizer.eos_token_ids), tokenizer) as served:
        yield served


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model and ring limits in this process: the engine's answers when nothing else is batched with them."""
    config = replace(ENGINE, model=str(model_dir), n_slots=32, scheduler=replace(ENGINE.scheduler, max_num_seqs=32))
    with Engine(config) as engine:
        yield engine


# -- the reference ---------------------------------------------------------------------------------------------------

def expected(reference, hf, prompt_ids, seed, max_tokens, stop=None):
    """(text, finish_reason, completion_tokens) the served engine + server must produce."""
    return expected_many(reference, hf, [prompt_ids], [seed], max_tokens, stop)[0]


def expected_many(reference, hf, prompts, seeds, max_tokens, stop=None):
    """``expected`` for several requests, generated together (the same tokens as one at a time)."""
    params = [SamplingParams(max_tokens=max_tokens, seed=seed) for seed in seeds]
    return [_finish(hf, out.token_ids, out.finish_reason, stop) for out in reference.generate(prompts, params)]


def _finish(hf, tokens, finish, stop):
    text = hf.decode(tokens, skip_special_tokens=True)
    if stop is not None and stop in text:
        # One stop string: generation ends at the first token whose text contains it.
        n = next(k for k in range(1, len(tokens) + 1) if stop in hf.decode(tokens[:k], skip_special_tokens=True))
        return text[:text.find(stop)], "stop", n
    return text, finish, len(tokens)


def chat_ids(hf, messages):
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def streamed(chunks, chat):
    text, finish, usage = "", None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


PROMPTS = ["Hello", "你好世界 👋🏽 — emoji and CJK", [1, 2, 3, 4000, 49151]]


# -- completions and chat --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("seed", [0, 12345])
def test_completions_streamed_and_not_match_the_engine(served, reference, hf, prompt, seed):
    ids = prompt if isinstance(prompt, list) else hf(prompt)["input_ids"]
    want_text, want_finish, n = expected(reference, hf, ids, seed, 16)
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=seed)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want_text, want_finish)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), n)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=seed, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage = streamed(chunks, chat=False)
    assert (text, finish, usage.completion_tokens) == (want_text, want_finish, n)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_engines_answers_for_consecutive_seeds(served, reference, hf, stream):
    """n > 1: one ring request per choice, seeds seed, seed + 1, ... (vLLM's rule for seeded requests)."""
    messages = [{"role": "user", "content": "Name a colour."}]
    want = expected_many(reference, hf, [chat_ids(hf, messages)] * 3, [40, 41, 42], 12)
    reply = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=40, n=3,
                                                    stream=stream,
                                                    stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = list(reply)
        got = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
               for i in range(3)}
        finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                    if c.choices and c.choices[0].finish_reason}
        usage = chunks[-1].usage
    else:
        got = {c.index: c.message.content for c in reply.choices}
        finishes = {c.index: c.finish_reason for c in reply.choices}
        usage = reply.usage
    assert [got[i] for i in range(3)] == [text for text, _, _ in want]
    assert [finishes[i] for i in range(3)] == [finish for _, finish, _ in want]
    assert usage.completion_tokens == sum(n for _, _, n in want)
    served.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_the_engine(served, reference, hf, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 你好 🌍"}]
    want_text, want_finish, n = expected(reference, hf, chat_ids(hf, messages), 7, 20)
    client = served.client()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, seed=7, stream=stream,
                                           stream_options={"include_usage": True} if stream else None)
    if stream:
        text, finish, usage = streamed(reply, chat=True)
    else:
        choice = reply.choices[0]
        text, finish, usage = choice.message.content, choice.finish_reason, reply.usage
        assert choice.message.role == "assistant"
    assert (text, finish, usage.completion_tokens) == (want_text, want_finish, n)


def test_chat_max_tokens_defaults_to_the_room_left(served, reference, hf):
    messages = [{"role": "user", "content": "go on"}]
    reply = served.client().chat.completions.create(model=MODEL, messages=messages, seed=3)
    want_text, want_finish, n = expected(reference, hf, chat_ids(hf, messages), 3, GEOMETRY.max_output_tokens)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens) == (
        want_text, want_finish, n)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens_ends_the_request(served, reference, hf, stream):
    prompt, seed = "Once upon a time", 99
    ids = hf(prompt)["input_ids"]
    tokens = reference.generate(ids, SamplingParams(max_tokens=20, seed=seed))[0].token_ids
    assert len(tokens) > 8
    # A stop string made of the end of token 5's text and the start of token 6's.
    boundary = len(hf.decode(tokens[:6], skip_special_tokens=True))
    full = hf.decode(tokens, skip_special_tokens=True)
    stop = full[boundary - 2:boundary + 2]
    want_text, want_finish, n = expected(reference, hf, ids, seed, 20, stop)
    assert want_finish == "stop" and n < 20
    client = served.client()
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, seed=seed, stop=[stop, "\x00"],
                                      stream=stream, stream_options={"include_usage": True} if stream else None)
    text, finish, usage = streamed(reply, chat=False) if stream else (
        reply.choices[0].text, reply.choices[0].finish_reason, reply.usage)
    assert (text, finish, usage.completion_tokens) == (want_text, "stop", n)
    served.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_that_meets_its_stop_string_stops_generating_while_the_others_go_on(served, reference, hf, stream):
    """n = 2, choice 0 meets its stop string within its first 8 tokens, choice 1 never: choice 0's ring request is
    cancelled at once, so the engine generates ~32 + 8 tokens for the request, not 2 x 32."""
    ids, seeds, n_tokens = hf("Once upon a time")["input_ids"], [5, 6], GEOMETRY.max_output_tokens
    outs = reference.generate([ids, ids], [SamplingParams(max_tokens=n_tokens, seed=s, ignore_eos=True) for s in seeds])
    texts = [hf.decode(out.token_ids, skip_special_tokens=True) for out in outs]
    early = hf.decode(outs[0].token_ids[:8], skip_special_tokens=True)
    stop = next(early[k:k + 3] for k in range(len(early) - 2) if early[k:k + 3] not in texts[1])
    before = served.wait_idle()["tokens"]
    reply = served.client().completions.create(model="smollm2-test", prompt="Once upon a time", max_tokens=n_tokens,
                                               seed=seeds[0], n=2, stop=[stop], stream=stream,
                                               extra_body={"ignore_eos": True})
    if stream:
        finishes = {c.choices[0].index: c.choices[0].finish_reason for c in reply if c.choices[0].finish_reason}
    else:
        finishes = {c.index: c.finish_reason for c in reply.choices}
    assert finishes == {0: "stop", 1: "length"}
    generated = served.wait_idle()["tokens"] - before
    assert n_tokens < generated < 2 * n_tokens - 8, generated


def test_chat_takes_max_tokens_when_max_completion_tokens_is_null(standin_served):
    body = {"model": MODEL, "messages": USER, "max_completion_tokens": None, "max_tokens": 3, "ignore_eos": True}
    status, _, response = raw_request(standin_served.port, CHAT, json.dumps(body).encode())
    assert status == 200 and json.loads(response)["usage"]["completion_tokens"] == 3


def test_logprobs_are_the_sampled_tokens(served, reference, hf):
    ids = hf("Hi")["input_ids"]
    want = reference.generate(ids, SamplingParams(max_tokens=6, seed=5, logprobs=True))[0]
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, seed=5, logprobs=0)
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert whole.choices[0].logprobs.tokens == [hf.decode([t]) for t in want.token_ids]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          seed=5, logprobs=True)
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(c.top_logprobs == [] and bytes(c.bytes) == c.token.encode() for c in chat.choices[0].logprobs.content)


def _chat_top(entries):
    """Chat logprobs content as plain values: per token (token, logprob, bytes, [(token, logprob, bytes)])."""
    return [(c.token, c.logprob, bytes(c.bytes), [(t.token, t.logprob, bytes(t.bytes)) for t in c.top_logprobs])
            for c in entries]


def test_top_logprobs_in_openais_shapes_whole_and_streamed(served, reference, hf):
    """Chat ``logprobs: true, top_logprobs: N`` and completions ``logprobs: N``: the reference engine's top tokens
    (which equal transformers' top-k log-probabilities: tests/test_sampling.py), decoded one by one, in OpenAI's
    objects; a stream's chunks carry the same entries."""
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = chat_ids(hf, messages)
    want = reference.generate([ids], SamplingParams(max_tokens=5, seed=9, logprobs=True, top_logprobs=3))[0]
    client = served.client()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=9, logprobs=True,
                                          top_logprobs=3)
    got = _chat_top(chat.choices[0].logprobs.content)
    text = lambda t: hf.decode([t])  # noqa: E731
    assert [(g[0], g[2], [(t, b) for t, _, b in g[3]]) for g in got] == [
        (text(t), text(t).encode(), [(text(i), text(i).encode()) for i, _ in top])
        for t, top in zip(want.token_ids, want.top_logprobs, strict=True)]
    for g, logprob, top in zip(got, want.logprobs, want.top_logprobs, strict=True):
        assert g[1] == pytest.approx(logprob, abs=1e-4)
        assert [lp for _, lp, _ in g[3]] == pytest.approx([lp for _, lp in top], abs=1e-4)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=9, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in _chat_top(c.choices[0].logprobs.content)]
    # The same tokens; the numbers to float32 rounding (the batch each step ran in may differ).
    assert [(e[0], [t for t, _, _ in e[3]]) for e in streamed] == [(e[0], [t for t, _, _ in e[3]]) for e in got]
    assert [e[1] for e in streamed] == pytest.approx([e[1] for e in got], abs=1e-4)
    prompt = hf("The sky is")["input_ids"]
    want = reference.generate([prompt], SamplingParams(max_tokens=4, seed=2, logprobs=True, top_logprobs=2))[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, seed=2, logprobs=2)
    top = whole.choices[0].logprobs.top_logprobs
    assert [list(d) for d in top] == [[text(i) for i, _ in step] + ([] if text(t) in map(text, dict(step)) else
                                                                    [text(t)])
                                      for t, step in zip(want.token_ids, want.top_logprobs, strict=True)]
    for d, step in zip(top, want.top_logprobs, strict=True):
        assert [d[text(i)] for i, _ in step] == pytest.approx([lp for _, lp in step], abs=1e-4)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, seed=2, logprobs=2, stream=True)
    streamed = [d for c in chunks for d in (c.choices[0].logprobs.top_logprobs if c.choices[0].logprobs else [])]
    assert [list(d) for d in streamed] == [list(d) for d in top]
    assert [v for d in streamed for v in d.values()] == pytest.approx([v for d in top for v in d.values()], abs=1e-4)


def test_logit_bias_and_min_p_reach_the_sampler(served, reference, hf):
    """Through the openai client: a +100 bias makes a token every token; a -100 bias keeps the greedy token out;
    min_p = 1 (an extra field for the client) samples the most likely token, as greedy decoding does."""
    client = served.client()
    prompt = hf("The capital of France is")["input_ids"]
    forced = hf(" banana")["input_ids"][0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == hf.decode([forced] * 4)
    greedy = reference.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(greedy[0]): -100})
    want = reference.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                       logit_bias={greedy[0]: -100}))[0].token_ids
    assert banned.choices[0].text == hf.decode(want) and want[0] != greedy[0]
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.5, seed=4,
                                        extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == hf.decode(greedy)


def test_concurrent_streams_all_complete(served, reference, hf):
    """16 streams on 8 ring slots: the agent queues the overflow and every stream gets its own exact text. 8 tokens
    each: the second half waits for the first to finish, so every token more is a step more of both halves."""
    client = served.client(openai.AsyncOpenAI)
    messages = [[{"role": "user", "content": f"request {i}"}] for i in range(16)]

    async def one(i):
        chunks = await client.chat.completions.create(model=MODEL, messages=messages[i], max_tokens=8, seed=i,
                                                      stream=True)
        return streamed([c async for c in chunks], chat=True)[:2]

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(all_of_them())
    want = expected_many(reference, hf, [chat_ids(hf, m) for m in messages], range(16), 8)
    assert results == [(text, finish) for text, finish, _ in want]
    served.wait_idle()


def test_models_lists_the_served_model(served):
    assert [m.id for m in served.client().models.list().data] == [MODEL]


# -- cancellation, back-pressure, health -----------------------------------------------------------------------------

def raw_request(port, path, body: bytes, method="POST") -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    result = response.status, dict(response.getheaders()), response.read()
    conn.close()
    return result


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("engine_holds_it", [False, True])
def test_client_disconnect_cancels_the_request_and_frees_its_slot(served, stream, engine_holds_it):
    """Disconnect while the request waits in the ring (READY) or runs in the engine (RUNNING, holding KV pages):
    either way it finishes as "abort", its slot comes back, and so does every KV page."""
    before = served.wait_idle()
    body = json.dumps({"model": MODEL, "prompt": "never read", "max_tokens": GEOMETRY.max_output_tokens,
                       "stream": stream}).encode()
    status = served.agent.layout.view(served.agent.memory.buffer).status

    def connect():
        sock = socket.create_connection(("127.0.0.1", served.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: served.on_loop(lambda: served.agent.in_flight) == 1)
        [slot] = (status["state"] != FREE).nonzero()[0]
        return sock, slot

    if engine_holds_it:
        sock, slot = connect()
        wait_for(lambda: status["state"][slot] == RUNNING)
    with served.paused_engine():
        # RUNNING is published at the end of the iteration that allocated the request's first pages (the gauge
        # in the control block may lag by that one iteration, so it is not checked here).
        if not engine_holds_it:
            sock, slot = connect()
        sock.close()
        # The server notices the disconnect while the GPU side is stalled and writes the cancel word.
        wait_for(lambda: status["cancel"][slot] == status["epoch"][slot])
    after = served.wait_idle()
    # Finished as "abort", not run to max_tokens; every slot and every KV page is free again.
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["finished"] == before["finished"] + 1
    assert served.on_loop(lambda: served.agent.tracker.n_free) == GEOMETRY.n_slots
    assert status["state"][slot] == FREE
    assert after["kv_pages_free"] == after["kv_pages_total"] > 0


def test_full_ring_queues_then_refuses_with_retry_after(served, reference, hf):
    """8 slots + 16 queued are accepted while the engine is stalled; the next request gets 429 + Retry-After."""
    client = served.client(openai.AsyncOpenAI)
    capacity = GEOMETRY.n_slots + CONFIG.loop.max_queued

    async def scenario():
        with served.paused_engine():
            tasks = [asyncio.create_task(client.completions.create(model=MODEL, prompt="queued", max_tokens=8,
                                                                   seed=i)) for i in range(capacity)]
            while served.on_loop(lambda: len(served.server.loop.waiting)) < CONFIG.loop.max_queued:
                await asyncio.sleep(0.01)
            status, headers, body = await asyncio.to_thread(
                raw_request, served.port, "/v1/completions", json.dumps({"prompt": "one too many"}).encode())
        return await asyncio.gather(*tasks), status, headers, json.loads(body)

    replies, status, headers, body = asyncio.run(scenario())
    assert status == 429 and headers["Retry-After"] == "1"
    assert "at capacity" in body["error"]["message"]
    ids = hf("queued")["input_ids"]
    want = expected_many(reference, hf, [ids] * capacity, range(capacity), 8)
    assert [r.choices[0].text for r in replies] == [text for text, _, _ in want]
    served.wait_idle()


def test_health_fails_while_the_engine_shows_no_sign_of_life(served):
    assert raw_request(served.port, "/health", b"", "GET")[0] == 200
    wait_for(lambda: served.on_loop(lambda: served.agent.stats()["alive"]) > 0)     # its process ticks by now
    with served.paused_engine():
        time.sleep(max(LIVENESS_TIMEOUT_S, TICK_FLOOR_S) + 0.5)     # the tick is judged over TICK_FLOOR_S at least
        status, headers, body = raw_request(served.port, "/health", b"", "GET")
        message = json.loads(body)["error"]["message"]
        assert status == 503 and "Retry-After" in headers
        assert "the engine process has not ticked" in message      # a stopped process stops its tick too
        status, _, body = raw_request(served.port, "/v1/completions", b'{"prompt": "x"}')
        assert status == 503 and "retry later" in json.loads(body)["error"]["message"]
    wait_for(lambda: raw_request(served.port, "/health", b"", "GET")[0] == 200)


def test_metrics_report_ring_counters_and_latencies(served):
    served.client().completions.create(model=MODEL, prompt="metrics", max_tokens=5, seed=1,
                                       extra_body={"ignore_eos": True})
    stats = served.wait_idle()
    samples = scrape(served)
    assert samples["blink_generation_tokens_total{}"] == stats["tokens"]
    assert samples["blink_engine_steps_total{}"] == stats["steps"]
    assert samples["blink_preemptions_total{}"] == stats["preempted"] == 0
    assert samples["blink_requests_running{}"] == 0 and samples["blink_requests_queued{}"] == 0
    assert samples["blink_prompt_tokens_total{}"] > 0
    assert samples['blink_requests_finished_total{"finish_reason": "length"}'] >= 1
    assert samples["blink_time_to_first_token_seconds_count{}"] >= 1
    assert samples["blink_e2e_request_latency_seconds_count{}"] >= 1
    assert "blink_kv_cache_usage_ratio{}" in samples and "blink_inter_token_latency_seconds_count{}" in samples
    assert "blink_http_time_to_first_chunk_seconds_count{}" in samples
    for name, word in [("blink_prefix_cache_queries_total{}", "prefix_query_tokens"),
                       ("blink_prefix_cache_hits_total{}", "prefix_hit_tokens"),
                       ("blink_prefix_cache_evictions_total{}", "prefix_evictions"),
                       ("blink_prefill_tokens_total{}", "prefill_tokens"),
                       ("blink_prefix_cache_pages{}", "cached_pages"),
                       ("blink_spec_decode_num_draft_tokens_total{}", "spec_draft_tokens"),
                       ("blink_spec_decode_num_accepted_tokens_total{}", "spec_accepted_tokens")]:
        assert samples[name] == stats[word], name
    assert stats["prefix_query_tokens"] > 0 and 0 <= samples["blink_prefix_cache_hit_rate{}"] <= 1


def test_http_time_to_first_chunk_times_each_streamed_request_around_its_ring_time(served):
    """One observation per streamed request, none for a whole answer; a request's HTTP time (arrival -> first chunk
    written) holds its ring time (submission -> first token), so the sums over the same requests are ordered."""
    http, ring = "blink_http_time_to_first_chunk_seconds", "blink_time_to_first_token_seconds"
    before = scrape(served)
    for seed in (1, 2):
        chunks = served.client().completions.create(model=MODEL, prompt="timed", max_tokens=4, seed=seed, stream=True)
        assert sum(1 for _ in chunks) >= 1
    served.wait_idle()
    streamed = scrape(served)
    change = {key: streamed[key + "{}"] - before[key + "{}"] for key in (f"{http}_count", f"{http}_sum",
                                                                          f"{ring}_count", f"{ring}_sum")}
    assert change[f"{http}_count"] == change[f"{ring}_count"] == 2
    assert change[f"{http}_sum"] >= change[f"{ring}_sum"] > 0
    served.client().completions.create(model=MODEL, prompt="whole", max_tokens=4, seed=3)
    served.wait_idle()
    after = scrape(served)
    assert after[f"{http}_count{{}}"] == streamed[f"{http}_count{{}}"]
    assert after[f"{ring}_count{{}}"] == streamed[f"{ring}_count{{}}"] + 1


def scrape(served) -> dict[str, float]:
    """The server's /metrics, ``name{labels as JSON}`` -> value."""
    _, _, body = raw_request(served.port, "/metrics", b"", "GET")
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


# -- bad input ---------------------------------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body, status, what the message must mention)
    (COMPLETIONS, b'{"prompt": "x"', 400, "not valid JSON"),
    (COMPLETIONS, b'[1, 2]', 400, "JSON object"),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    (COMPLETIONS, b'{"prompt": "\\ud800"}', 400, "surrogate"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "10"}, 400, "'max_tokens' must be an integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "'max_tokens' must be an integer >= 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**30}, 400, "lower max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "not valid JSON"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    (COMPLETIONS, {"prompt": 5}, 400, "'prompt' must be"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "one request per prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt is empty"),
    (COMPLETIONS, {"prompt": [49152]}, 400, "token ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": [1, -1]}, 400, "token ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": [1, True]}, 400, "token ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": [1, 2.0]}, 400, "token ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": [[1, "a"]]}, 400, "token ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [1, False]}, 400, "token ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": "hello " * 300}, 400, "shorten it"),
    (COMPLETIONS, {"prompt": [1] * 257}, 400, "at most 256"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    (COMPLETIONS, {"prompt": "x", "n": 17}, 400, "'n' must be an integer in [1, 16]"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 6}, 400, "'logprobs' asks for 6 top logprobs per token, but this "
                                                      "server keeps at most 5: start it with --max-top-logprobs 6"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "'logprobs' must be an integer in [0, 20]"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, 400, "'logprobs' must be an integer"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"49152": 1}}, 400, "'logit_bias' must be an object mapping token "
                                                                   "ids in [0, 49152)"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 100.5}}, 400, "to numbers in [-100, 100]"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": "up"}}, 400, "'logit_bias' must be"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"-5": 1}}, 400, "'logit_bias' must be"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5" * 5000: 1}}, 400, "'logit_bias' must be"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": [[5, 1]]}, 400, "'logit_bias' must be"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 1, "05": 2}}, 400, "names a token id twice"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {str(t): 1 for t in range(5)}}, 400,
     "'logit_bias' asks for 5 tokens, but this server keeps at most 4: start it with --max-logit-bias 5"),
    (COMPLETIONS, {"prompt": "x", "stop": 5}, 400, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "non-empty"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 17}, 400, "at most 16"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [1] * 5}, 400, "at most 4 token ids"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 2.5}, 400, "'presence_penalty' must be a number in [-2, 2]"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": "high"}, 400, "'frequency_penalty' must be a number"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400, "'repetition_penalty' must be a number > 0"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 3.5e38}, 400, "'repetition_penalty' must be a number in"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": 3}, 400, "not supported"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, 400, "not supported"),
    (COMPLETIONS, {"prompt": "x", "best_of": True}, 400, "not supported"),        # true == 1, but not an int
    (COMPLETIONS, {"prompt": "x", "best_of": 1.0}, 400, "not supported"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, 400, "'min_p' must be a number in [0, 1]"),
    (COMPLETIONS, {"prompt": "x", "min_p": -0.1}, 400, "'min_p' must be a number in [0, 1]"),
    (CHAT, {"messages": USER, "min_p": "0.1"}, 400, "'min_p' must be a number"),
    (COMPLETIONS, {"prompt": "x", "num_speculative_tokens": 17}, 400, "'num_speculative_tokens' must be an integer in "
                                                                      "[0, 16] (0: no drafts for this request)"),
    (CHAT, {"messages": USER, "num_speculative_tokens": -1}, 400, "'num_speculative_tokens' must be an integer"),
    (CHAT, {"messages": USER, "num_speculative_tokens": 2.0}, 400, "'num_speculative_tokens' must be an integer"),
    (COMPLETIONS, {"prompt": "x", "temperature": 10**400}, 400, "'temperature' must be"),   # beyond any float
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "only for streamed answers"),
    (CHAT, {"messages": []}, 400, "non-empty list"),
    (CHAT, {"messages": "hi"}, 400, "non-empty list"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "'role'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "only text"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, 400, "'top_logprobs' needs \"logprobs\": true"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be an integer in "
                                                                          "[0, 20]"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 6}, 400, "start it with --max-top-logprobs 6"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "'tools[0]' must be"),
    (COMPLETIONS, {"prompt": "x", "tools": [{"type": "function"}]}, 400, "not supported"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "GET /v1/models"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 300}]}, 400, "shorten it"),
    (CHAT, {"messages": [{"role": "user", "content": ""}] * 60}, 400, "each message takes at least 5"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "'max_completion_tokens' must be an integer >= 1"),
    (CHAT, {"messages": USER, "max_completion_tokens": 10**30}, 400, "lower max_completion_tokens"),
    ("/v1/nothing", {}, 404, "Not Found"),
    (COMPLETIONS, b"x" * (2 << 20), 413, "at most 1048576 are accepted"),
]


@pytest.mark.parametrize("path, body, status, mention", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(standin_served, path, body, status, mention):
    served = standin_served
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, _, response = raw_request(served.port, path, raw)
    error = json.loads(response)["error"]
    assert (got, set(error)) == (status, {"message", "type", "param", "code"})
    assert mention in error["message"]
    assert served.client().completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].text


def test_wrong_method_is_a_json_405(standin_served):
    served = standin_served
    status, headers, body = raw_request(served.port, "/v1/completions", b"", "GET")
    assert status == 405 and "Method Not Allowed" in json.loads(body)["error"]["message"]
    assert headers["Allow"] == "POST"


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                           allow_infinity=False) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=8)
# Mostly valid values near the edges, so that many fuzzed requests are served rather than rejected.
good_values = {
    "max_tokens": st.integers(-1, 70), "temperature": st.floats(-0.5, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50), "seed": st.integers(-2**64, 2**65), "n": st.sampled_from([1, 1, 1, 2]),
    "stream": st.booleans(), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "ignore_eos": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop_token_ids": st.lists(st.integers(-1, 49152), max_size=5), "priority": st.integers(-5, 5),
    "presence_penalty": st.floats(-2.5, 2.5), "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(-0.5, 3), "min_p": st.floats(-0.5, 1.5),
    "num_speculative_tokens": st.integers(-1, 17),
    "logit_bias": st.dictionaries(st.integers(-1, 49152).map(str), st.floats(-110, 110), max_size=5),
}
prompts = {COMPLETIONS: {"prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 49151), max_size=8),
                         "logprobs": st.sampled_from([None, 0, 0, 1, 5, 6])},
           CHAT: {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                              "content": st.text(max_size=30)}), max_size=3),
                  "logprobs": st.booleans(), "top_logprobs": st.sampled_from([None, 0, 3, 5, 6]),
                  # tool calling (tests/nic/openai/test_tools.py): valid tools, and every choice
                  "tools": st.sampled_from([None, [], [{"type": "function", "function": {"name": "f"}}]]),
                  "tool_choice": st.sampled_from([None, "none", "auto", "required",
                                                  {"type": "function", "function": {"name": "f"}}]),
                  "parallel_tool_calls": st.booleans()}}


# Every numeric field at the limits of the types that store it: the ring header's u32 / i32 / u64 / f32, Python's
# float, JSON's unbounded integers (the adversarial pass found top_k = 2**31 leaking a slot per request).
TYPE_LIMITS = [0, 1, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
               -2**63 - 1, 10**30,
               0.0, -0.0, 1e-45, 1e-39, 1e-5, 0.5, 3.4e38, 3.5e38, 1e308, -1e308, 1.7976931348623157e308]
NUMERIC_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "priority", "n",
                  "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of",
                  "min_p", "num_speculative_tokens"]


@st.composite
def requests(draw):
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    body = {"model": MODEL, "max_tokens": 8, **draw(st.fixed_dictionaries(prompts[path]))}
    body.update(draw(st.fixed_dictionaries({}, optional=good_values)))
    body.update(draw(st.dictionaries(st.sampled_from(sorted([*good_values, *prompts[path]])), json_values,
                                     max_size=2)))
    body.update(draw(st.dictionaries(st.sampled_from(NUMERIC_FIELDS), st.sampled_from(TYPE_LIMITS), max_size=3)))
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.lists(st.sampled_from(TYPE_LIMITS), max_size=3))
    return path, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(request=requests())
def test_fuzzed_requests_never_get_a_5xx(standin_served, request):
    served = standin_served
    path, body = request
    status, _, response = raw_request(served.port, path, json.dumps(body).encode())
    assert status < 500, response
    if status != 200:
        assert set(json.loads(response)["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert response.endswith(b"data: [DONE]\n\n")


def test_no_slot_is_left_behind_by_the_fuzzed_requests(standin_served):
    """Run after the fuzzer (same module, same server): every ring slot is back with the agent, every request the
    ring saw has finished, and a normal request is still served."""
    served = standin_served
    stats = served.wait_idle()
    assert served.on_loop(lambda: served.agent.tracker.n_free) == GEOMETRY.n_slots
    assert stats["finished"] == stats["submitted"] and stats["running"] == stats["waiting"] == 0
    body = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2}).encode()
    assert raw_request(served.port, COMPLETIONS, body)[0] == 200


# -- command line ------------------------------------------------------------------------------------------------------

CLI_ENGINE = ["--device", "cpu", "--slots", "4", "--max-prompt-tokens", "64", "--max-output-tokens", "16",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--cpu-kv-cache-gib", "0.05"]


def blink_cli(*args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "blink.cli", *args], **popen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_processes(pid: int) -> list[int]:
    """The engine processes (multiprocessing spawns) among ``pid``'s children; one that ends meanwhile is left out."""
    found = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(child)
        except (FileNotFoundError, ProcessLookupError):
            pass    # a short-lived helper (a probe, a compiler) that ended between the listing and this read
    return found


def check_completion(port, reference, hf) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    text = client.completions.create(model=MODEL, prompt="cli", max_tokens=5, seed=2, temperature=1.0).choices[0].text
    assert text == expected(reference, hf, hf("cli")["input_ids"], 2, 5)[0]


def test_blink_engine_and_blink_agent_serve_a_ring_and_stop_on_ctrl_c(model_dir, reference, hf):
    from blink.ring.control import MAGIC

    ring, port = f"blink-test-cli-{os.getpid()}", free_port()
    engine = blink_cli("engine", str(model_dir), "--ring", ring, *CLI_ENGINE)
    agent = None
    try:
        def ring_ready():
            with open(f"/dev/shm/{ring}", "rb") as f:
                return int.from_bytes(f.read(4), "little") == MAGIC
        wait_for(lambda: os.path.exists(f"/dev/shm/{ring}") and ring_ready(), timeout_s=120)
        agent = blink_cli("agent", "--ring", ring, "--model", str(model_dir), "--port", str(port),
                          "--served-model-name", MODEL)
        wait_for(lambda: _healthy(port), timeout_s=120)
        check_completion(port, reference, hf)
        for process in (agent, engine):
            process.send_signal(signal.SIGINT)
            assert process.wait(60) == 0
        assert not os.path.exists(f"/dev/shm/{ring}")
    finally:
        for process in (agent, engine):
            if process is not None:
                process.kill()


def test_blink_serve_runs_the_engine_process_and_ctrl_c_stops_both(model_dir, reference, hf):
    port = free_port()
    # Where this user may raise priorities, the agent (this process) takes nice -10 and the engine keeps its own.
    high = subprocess.run([sys.executable, "-c", "import os; os.setpriority(os.PRIO_PROCESS, 0, -10)"]).returncode == 0
    serve = blink_cli("serve", str(model_dir), "--port", str(port), "--served-model-name", MODEL, *CLI_ENGINE,
                      *(["--agent-priority", "high"] if high else []), start_new_session=True)
    try:
        wait_for(lambda: _healthy(port), timeout_s=120)
        check_completion(port, reference, hf)
        spawned = children(serve.pid)
        assert spawned, "the engine runs in a process of its own"
        engines = [pid for pid in engine_processes(serve.pid) if pid in spawned]
        if len(os.sched_getaffinity(0)) >= 2:       # the agent keeps a core of its own, the engine the others
            assert engines and all(not os.sched_getaffinity(pid) & os.sched_getaffinity(serve.pid)
                                   for pid in engines)
        if high:
            assert os.getpriority(os.PRIO_PROCESS, serve.pid) == -10
            assert engines and all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in engines)
        os.killpg(serve.pid, signal.SIGINT)          # as a terminal's Ctrl-C: to the whole process group
        assert serve.wait(60) == 0
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in spawned), timeout_s=30)
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"blink-{serve.pid}-")]
    finally:
        serve.kill()


@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "from blink.host.priority import set_priority; "
                                     "assert set_priority('deadline').startswith('deadline')"]).returncode != 0,
                    reason="needs CAP_SYS_NICE and a host whose scheduling domain this process spans")
def test_blink_serve_agent_priority_deadline_runs_the_agent_unpinned_in_sched_deadline():
    """The kernel refuses SCHED_DEADLINE to a thread held to some cores: the agent takes the class first and is then
    not pinned (it runs on whichever core it wakes to find); the engine process stays normal, off the agent's core."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                              "--slots", "4", "--max-model-len", "256", "--agent-priority", "deadline"],
                             start_new_session=True)
    try:
        wait_for(lambda: _healthy(port), timeout_s=60)
        assert os.sched_getscheduler(serve.pid) & ~0x40000000 == 6          # SCHED_DEADLINE, reset on fork
        assert os.sched_getaffinity(serve.pid) == os.sched_getaffinity(0)
        engines = engine_processes(serve.pid)
        assert engines and all(os.sched_getscheduler(pid) == os.SCHED_OTHER for pid in engines)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(60)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the agent and one for the rest")
def test_blink_serve_reserve_agent_cores_serves_whether_the_host_grants_the_partition_or_not(tmp_path):
    """Granted (root, cgroup v2), the agent runs in its partition, alone on its core, and the partition is gone after
    exit; refused (cgroup v1, no root, a cgroup namespace), one warning says why and the server serves as without."""
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as stderr:
        serve = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                                  "--slots", "4", "--max-model-len", "256", "--reserve-agent-cores"],
                                 stderr=stderr, start_new_session=True)
    partition = f"/sys/fs/cgroup/blink-agent-{serve.pid}"
    try:
        wait_for(lambda: _healthy(port), timeout_s=60)
        status, _, body = raw_request(port, "/v1/completions", json.dumps(
            {"model": json.loads(raw_request(port, "/v1/models", b"", "GET")[2])["data"][0]["id"], "prompt": "hi",
             "max_tokens": 3}).encode())
        assert status == 200, body
        lines = log.read_text().splitlines()
        granted = [line for line in lines if "agent on its own cpuset partition" in line]
        refused = [line for line in lines if line.startswith("blink: --reserve-agent-cores: ")]
        assert len(granted) + len(refused) == 1, lines
        if granted:
            agent_core = os.sched_getaffinity(serve.pid)
            assert len(agent_core) == 1 and not agent_core & os.sched_getaffinity(0)
            assert open(f"/proc/{serve.pid}/cgroup").read().strip() == f"0::/blink-agent-{serve.pid}"
        else:
            assert refused[0].endswith("stay shared with the host") and not os.path.exists(partition)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(60)
    assert not os.path.exists(partition)


def test_blink_serve_keeps_its_startup_heap_out_of_the_garbage_collectors_scans():
    """A full collection over the start-up heap (torch, the tokenizer) took 34-155 ms of the agent's event loop:
    ``blink serve`` freezes that heap before it serves, says how many objects it kept out, then serves."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", "--standin", "--port", str(port),
                              "--slots", "4", "--max-model-len", "256"], stderr=subprocess.PIPE, text=True)
    try:
        line = next((line for line in serve.stderr if "kept out of the garbage collector's scans" in line), "")
        assert line.startswith("blink: ") and int(line.split()[1]) > 10_000, line
        wait_for(lambda: _healthy(port), timeout_s=60)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.communicate(timeout=30)


def test_blink_serve_reports_a_bad_engine_config_in_one_line(model_dir):
    done = subprocess.run([sys.executable, "-m", "blink.cli", "serve", str(model_dir), "--device", "cpu",
                           "--max-model-len", "9000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "max_model_len=9000 is longer than the model's context" in done.stderr
    assert "Traceback" not in done.stderr


def _healthy(port) -> bool:
    try:
        return raw_request(port, "/health", b"", "GET")[0] == 200
    except OSError:
        return False


def test_blink_serve_exits_non_zero_when_its_engine_is_killed(model_dir):
    """Regression (engine death detected but never handled): after kill -9 of the engine, serve answered 503 forever
    beside a zombie. Now requests in flight end with an error, and serve exits with code 1 for its supervisor."""
    port = free_port()
    serve = blink_cli("serve", str(model_dir), "--port", str(port), "--standin", "--slots", "8",
                      "--max-model-len", "512")
    try:
        wait_for(lambda: _healthy(port), timeout_s=60)
        (engine,) = engine_processes(serve.pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=client.models.list().data[0].id, prompt="a", max_tokens=2).choices
        os.kill(engine, signal.SIGKILL)
        assert serve.wait(30) == 1
        assert not os.path.exists(f"/proc/{engine}") or open(f"/proc/{engine}/stat").read().split()[2] != "Z"
    finally:
        serve.kill()


def test_a_stale_ring_under_the_engines_name_is_never_attached(model_dir, tmp_path):
    """Regression (stale ring attach): a ring a killed server left under a reused name (PID reuse: PID 1 in
    containers) made the new engine fail while the agent attached to the dead ring and served 503 forever. Now
    names carry a random part, and the agent attaches only to a ring whose creator is its own engine process."""
    from blink.host.process import attach_ring
    from blink.ring.geometry import RingGeometry
    from blink.ring.layout import RingLayout
    from blink.ring.transport import SharedMemory

    name = f"blink-test-stale-{os.getpid()}"
    layout = RingLayout(RingGeometry(n_slots=4, max_prompt_tokens=8, max_output_tokens=8))
    with SharedMemory.create(name, layout.size) as stale:
        layout.initialise(stale)                  # a fully initialised ring, created by this (other) process
        config = replace(ENGINE, model=str(model_dir), ring_name=name)
        process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(3,))
        process.start()
        with pytest.raises(EngineError, match="exited .* before it created its ring"):
            attach_ring(config, process, timeout_s=30)
        with pytest.raises(FileExistsError, match="exists already .* remove the file if no engine runs on it"):
            SharedMemory.create(name, layout.size)
    from blink.cli import _ring_name
    assert _ring_name() != _ring_name()


def test_api_key_from_the_option_a_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("sesame\n")
    monkeypatch.setenv("BLINK_API_KEY", "from-env")
    assert api_key_from("opened", None) == "opened"
    assert api_key_from(None, str(key_file)) == "sesame"
    assert api_key_from(None, None) == "from-env"
    monkeypatch.delenv("BLINK_API_KEY")
    assert api_key_from(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        api_key_from("opened", str(key_file))
    key_file.write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        api_key_from(None, str(key_file))
    with pytest.raises(ValueError, match="cannot read the key"):
        api_key_from(None, str(tmp_path / "missing"))


def test_serve_with_max_model_len_alone_an_api_key_and_a_policy(model_dir, tmp_path):
    """vLLM users' options: --max-model-len alone sizes the ring (and /v1/models reports it, and a longer request is
    a 400 naming it); --api-key-file gates /v1 (401 without the key, with the official client; the key is not on
    the command line for ps to show, and the scheme is case-insensitive); --policy reaches the GPU scheduler: with
    one running sequence at a time, waiting requests are admitted lowest priority value first."""
    port = free_port()
    (tmp_path / "key").write_text("sesame\n")
    serve = blink_cli("serve", str(model_dir), "--port", str(port), "--served-model-name", MODEL, "--device", "cpu",
                      "--max-model-len", "96", "--max-num-seqs", "1", "--max-num-batched-tokens", "64",
                      "--cpu-kv-cache-gib", "0.05", "--api-key-file", str(tmp_path / "key"), "--policy",
                      "blink.device.policy:by_priority")
    try:
        wait_for(lambda: _healthy(port), timeout_s=120)       # /health needs no key
        with open(f"/proc/{serve.pid}/cmdline", "rb") as cmdline:
            assert b"sesame" not in cmdline.read()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:     # RFC 7235: any case
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: bearer sesame\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 200 ")
        url = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:     # a key that is not UTF-8
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: Bearer \xff\xfe\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 401 ")
        client = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0)
        assert client.models.list().data[0].model_extra["max_model_len"] == 96
        with pytest.raises(openai.BadRequestError, match="max_model_len is 96"):
            client.completions.create(model=MODEL, prompt=[5] * 90, max_tokens=10)
        aclient = openai.AsyncOpenAI(base_url=url, api_key="sesame", max_retries=0)

        async def by_priority():
            done = []

            async def one(priority):
                await aclient.completions.create(model=MODEL, prompt=[7, 8], max_tokens=1,
                                                 extra_body={"priority": priority})
                done.append(priority)

            first = asyncio.create_task(aclient.completions.create(
                model=MODEL, prompt=[5], max_tokens=24, extra_body={"ignore_eos": True, "priority": -100}))
            await asyncio.sleep(0.3)                   # it runs; the others wait in the GPU's queue
            await asyncio.gather(first, *(one(p) for p in (5, -3, 9, 0)))
            return done

        assert asyncio.run(by_priority()) == [-3, 0, 5, 9]
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(60)
        serve.kill()
