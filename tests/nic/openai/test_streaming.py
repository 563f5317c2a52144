"""The agent's fan-out under many streams: one poll serves every stream that moved, each stream's SSE chunks go out
in one write per wake-up, and every stream gets every token, in order. The server runs in the test's event loop
over an in-process ring whose reference consumer the test steps by hand, so each step is one token for every stream
and the test decides when the next one comes. What the client sees is read HTTP chunk by HTTP chunk: one chunk per
write of the server."""
import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from blink.models import default_model_path
from blink.nic.agent import Agent
from blink.nic.agent_loop import AgentLoop, LoopConfig
from blink.nic.metrics import Metrics
from blink.nic.openai.requests import Parser
from blink.nic.openai.responses import Responder
from blink.nic.openai.server import OpenAIServer, ServerConfig, start
from blink.nic.text import Tokenizer
from blink.ring.control import ENGINE_SERVING
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.reference import ReferenceConsumer, expected_output
from blink.ring.request import SamplingParams
from blink.ring.transport import LocalMemory

STREAMS, TOKENS = 64, 12
GEOMETRY = RingGeometry(n_slots=STREAMS, max_prompt_tokens=16, max_output_tokens=TOKENS, max_model_len=64)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_path())


def stepped_ring(tokenizer):
    """An in-process ring served by a reference consumer the test steps by hand; (consumer, agent)."""
    layout = RingLayout(GEOMETRY)
    memory = LocalMemory(layout.size)
    layout.initialise(memory)
    consumer = ReferenceConsumer(layout.view(memory.buffer), vocab_size=tokenizer.vocab_size, max_running=STREAMS)
    consumer.view.control["engine_state"] = ENGINE_SERVING
    return consumer, Agent(memory, GEOMETRY)


def completion(prompt: list[int], seed: int) -> dict:
    return {"prompt": prompt, "max_tokens": TOKENS, "seed": seed, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def expected_text(tokenizer, prompt: list[int], seed: int) -> str:
    tokens, _ = expected_output(prompt, SamplingParams(max_tokens=TOKENS, seed=seed, ignore_eos=True),
                                vocab_size=tokenizer.vocab_size)
    return tokenizer.decode(tokens)


def text_of(frames) -> str:
    return "".join(e["choices"][0]["text"] for frame in frames for e in frame if isinstance(e, dict) and e["choices"])


async def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def stream_frames(session, url: str, body: dict) -> list[list[dict | str]]:
    """One streamed completion; each HTTP chunk (one write of the server) as its list of SSE events."""
    frames, data = [], b""
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for piece, end_of_chunk in response.content.iter_chunks():
            data += piece
            if end_of_chunk:
                events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
                frames.append([e.decode() if e == b"[DONE]" else json.loads(e) for e in events])
                data = b""
    return frames


@pytest.mark.parametrize("poll_interval_s", [LoopConfig.poll_interval_s, 0.0])    # sleeping polls, and spinning
def test_one_poll_serves_every_stream_and_each_gets_every_token_in_order(tokenizer, poll_interval_s):
    consumer, agent = stepped_ring(tokenizer)
    batches = []                # how many streams each poll that found progress served
    real_poll = agent.poll

    def poll():
        outputs = real_poll()
        if outputs:
            batches.append(len(outputs))
        return outputs

    agent.poll = poll
    prompts = [[1 + i, 2 + i, 3] for i in range(STREAMS)]

    async def run():
        config = ServerConfig(model_name="m", loop=LoopConfig(poll_interval_s=poll_interval_s))
        listening = await start(OpenAIServer(agent, tokenizer, config), "127.0.0.1", 0)  # and the polling task
        url = f"http://127.0.0.1:{listening.port}/v1/completions"
        try:
            async with aiohttp.ClientSession() as session:
                clients = [asyncio.create_task(stream_frames(session, url, completion(prompt, seed)))
                           for seed, prompt in enumerate(prompts)]
                await until(lambda: agent.in_flight == STREAMS)
                for step in range(TOKENS):
                    consumer.step()         # one token for every stream
                    await until(lambda: sum(batches) == STREAMS * (step + 1))
                return await asyncio.gather(*clients)
        finally:
            await listening.cleanup()

    streams = asyncio.run(run())
    assert batches == [STREAMS] * TOKENS, "each poll found every stream moved and served them all"
    for seed, (prompt, frames) in enumerate(zip(prompts, streams, strict=True)):
        assert text_of(frames) == expected_text(tokenizer, prompt, seed), f"stream {seed}: every token, in order"
        assert all(len(frame) == 1 for frame in frames[:-1]), "one event per write while one token per poll came"
        last, usage, done = frames[-1]      # the last token's chunk, the usage and [DONE]: one write
        assert last["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == TOKENS


def test_a_handler_that_slept_through_several_polls_sends_them_in_one_write(tokenizer):
    """A stream whose handler was busy (say, waiting for a slow client) while the polls went on gets every output
    delivered meanwhile in one write: here all of them, each still its own chunk, in order."""
    consumer, agent = stepped_ring(tokenizer)
    prompt, seed = [5, 6, 7], 11
    job = Parser(tokenizer, "m", agent).completion(completion(prompt, seed))

    async def run():
        metrics = Metrics()
        loop = AgentLoop(agent, metrics)
        req = loop.submit(job.prompt, job.params, job.priority)
        for _ in range(TOKENS):             # the polls the handler slept through: one output each
            consumer.step()
            for out in agent.poll():
                req.queue.put_nowait(out)
        assert req.queue.qsize() == TOKENS
        async def handler(request):
            return await Responder(tokenizer, "m", metrics, loop.close).stream(request, job, [req])

        app = web.Application()
        app.router.add_post("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await stream_frames(session, f"http://127.0.0.1:{runner.addresses[0][1]}/", {})
        finally:
            await runner.cleanup()

    frames = asyncio.run(run())
    assert len(frames) == 1, "one write"
    assert text_of(frames) == expected_text(tokenizer, prompt, seed)
    *chunks, usage, done = frames[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
