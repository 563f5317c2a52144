"""The agent's fan-out under many streams: one poll serves every stream that moved, each stream's SSE chunks go out
in one write per poll, every stream gets every token, in order, and a client that reads slowly holds up no other.
The server runs in the test's event loop over an in-process ring whose reference consumer the test steps by hand, so
each step is one token for every stream and the test decides when the next one comes. What the client sees is read
HTTP chunk by HTTP chunk: one chunk per write of the server."""
import asyncio
import json
import socket
import time

import aiohttp
import pytest

from blink.models import default_model_path
from blink.nic.agent import Agent
from blink.nic.agent_loop import LoopConfig
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


def counted_polls(agent) -> list[int]:
    """How many requests each of ``agent``'s polls that found progress served, as the polls come."""
    served, real_poll = [], agent.poll

    def poll():
        outputs = real_poll()
        if outputs:
            served.append(len(outputs))
        return outputs

    agent.poll = poll
    return served


def completion(prompt: list[int], seed: int) -> dict:
    return {"prompt": prompt, "max_tokens": TOKENS, "seed": seed, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def expected_text(tokenizer, prompt: list[int], seed: int, max_tokens: int = TOKENS) -> str:
    tokens, _ = expected_output(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True),
                                vocab_size=tokenizer.vocab_size)
    return tokenizer.decode(tokens)


def text_of(frames) -> str:
    return "".join(e["choices"][0]["text"] for frame in frames for e in frame if isinstance(e, dict) and e["choices"])


async def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def stream_frames(session, url: str, body: dict, responded=lambda: None) -> list[list[dict | str]]:
    """One streamed completion; each HTTP chunk (one write of the server) as its list of SSE events.
    ``responded()`` is called once the response's headers are in. aiohttp's reader can report the body's closing
    zero-length chunk as one more chunk end when the last data chunk was read before it came; that end carries no
    bytes, so it is no write of the server and makes no frame."""
    frames, data = [], b""
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        responded()
        async for piece, end_of_chunk in response.content.iter_chunks():
            data += piece
            if end_of_chunk and data:
                events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
                frames.append([e.decode() if e == b"[DONE]" else json.loads(e) for e in events])
                data = b""
    return frames


@pytest.mark.parametrize("poll_interval_s", [LoopConfig.poll_interval_s, 0.0])    # sleeping polls, and spinning
def test_one_poll_serves_every_stream_and_each_gets_every_token_in_order(tokenizer, poll_interval_s):
    consumer, agent = stepped_ring(tokenizer)
    batches = counted_polls(agent)
    prompts = [[1 + i, 2 + i, 3] for i in range(STREAMS)]

    async def run():
        config = ServerConfig(model_name="m", loop=LoopConfig(poll_interval_s=poll_interval_s))
        listening = await start(OpenAIServer(agent, tokenizer, config), "127.0.0.1", 0)  # and the polling task
        url = f"http://127.0.0.1:{listening.port}/v1/completions"
        try:
            async with aiohttp.ClientSession() as session:
                responded = []
                clients = [asyncio.create_task(stream_frames(session, url, completion(prompt, seed),
                                                             lambda: responded.append(True)))
                           for seed, prompt in enumerate(prompts)]
                # Every answer's headers are out first: an answer gets its connection once they are (``attach``), and
                # one that got it late on a busy box rightly sent the two tokens it held by then in one write.
                await until(lambda: agent.in_flight == STREAMS and len(responded) == STREAMS)
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


def test_the_choices_of_one_request_that_moved_in_one_poll_go_out_in_one_write(tokenizer):
    consumer, agent = stepped_ring(tokenizer)
    polls = counted_polls(agent)
    prompt, seed, n = [4, 5, 6], 21, 3

    async def run():
        listening = await start(OpenAIServer(agent, tokenizer, ServerConfig(model_name="m")), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                client = asyncio.create_task(stream_frames(session, f"http://127.0.0.1:{listening.port}/v1/completions",
                                                           {**completion(prompt, seed), "n": n}))
                await until(lambda: agent.in_flight == n)
                for step in range(TOKENS):
                    consumer.step()         # one token for every choice
                    await until(lambda: sum(polls) == n * (step + 1))
                return await client
        finally:
            await listening.cleanup()

    frames = asyncio.run(run())
    assert polls == [n] * TOKENS, "each poll found every choice moved"
    *frames, (*last, usage, done) = frames
    frames.append(last)
    assert len(frames) <= TOKENS, "at most one write per poll"
    assert max(len(frame) for frame in frames) == n, "a poll's chunks of every choice in one write"
    for frame in frames:
        indices = [chunk["choices"][0]["index"] for chunk in frame]
        assert indices == sorted(set(indices)), "each choice at most once a write, in choice order"
    for i in range(n):
        text = "".join(c["choices"][0]["text"] for frame in frames for c in frame if c["choices"][0]["index"] == i)
        assert text == expected_text(tokenizer, prompt, seed + i), f"choice {i}: every token, in order"
    assert done == "[DONE]" and usage["usage"]["completion_tokens"] == n * TOKENS


def test_an_http_1_0_client_gets_the_stream_unframed_until_the_server_closes_the_connection(tokenizer):
    """HTTP/1.0 has no chunked framing: the events are the body as they are, and the connection's close ends it."""
    consumer, agent = stepped_ring(tokenizer)
    polls = counted_polls(agent)
    prompt, seed = [3, 4], 5
    body = json.dumps(completion(prompt, seed)).encode()

    async def run():
        listening = await start(OpenAIServer(agent, tokenizer, ServerConfig(model_name="m")), "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listening.port)
            writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await until(lambda: agent.in_flight == 1)
            for step in range(TOKENS):
                consumer.step()
                await until(lambda: sum(polls) == step + 1)
            data = await asyncio.wait_for(reader.read(), 30)      # to the end of the connection
            writer.close()
            return data
        finally:
            await listening.cleanup()

    head, _, data = asyncio.run(run()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head.lower()
    *chunks, usage, done = [e.decode() if e == b"[DONE]" else json.loads(e)
                            for e in (e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e)]
    assert text_of([chunks]) == expected_text(tokenizer, prompt, seed) and done == "[DONE]"
    assert usage["usage"]["completion_tokens"] == TOKENS


LONG = 4096         # tokens of the slow reader's stream: ~700 kB of chunks
LONG_GEOMETRY = RingGeometry(n_slots=2, max_prompt_tokens=16, max_output_tokens=LONG, max_model_len=LONG + 16)


async def read_http_chunks(sock: socket.socket) -> list[bytes]:
    """A chunked HTTP response's body, read off ``sock`` to its last chunk: one bytes per HTTP chunk (one write of
    the server)."""
    loop, data = asyncio.get_running_loop(), b""

    async def until_in_data(marker: bytes, start: int) -> int:
        nonlocal data
        while (at := data.find(marker, start)) < 0:
            piece = await loop.sock_recv(sock, 1 << 16)
            assert piece, "the server closed the connection before the last chunk"
            data += piece
        return at

    at = await until_in_data(b"\r\n\r\n", 0) + 4
    assert data.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in data[:at].lower()
    chunks = []
    while True:
        line_end = await until_in_data(b"\r\n", at)
        size = int(data[at:line_end], 16)
        if not size:
            return chunks
        at = line_end + 2
        while len(data) < at + size + 2:
            await until_in_data(b"\r\n", len(data))
        chunks.append(data[at:at + size])
        at += size + 2


def test_a_client_that_reads_slowly_stalls_no_other_stream_and_gets_every_token_in_order(tokenizer):
    """A client that reads nothing while its stream runs: once its connection is backed up the polling task no
    longer writes to it and its chunks wait for it; the other stream is served to its end meanwhile. When it reads,
    it gets every token, in order, the chunks of the polls it was behind in fewer writes than polls."""
    layout = RingLayout(LONG_GEOMETRY)
    memory = LocalMemory(layout.size)
    layout.initialise(memory)
    consumer = ReferenceConsumer(layout.view(memory.buffer), vocab_size=tokenizer.vocab_size, max_running=2)
    consumer.view.control["engine_state"] = ENGINE_SERVING
    agent = Agent(memory, LONG_GEOMETRY)
    polls = counted_polls(agent)
    (slow_prompt, slow_seed), (fast_prompt, fast_seed) = ([5, 6, 7], 11), ([8, 9], 12)
    body = json.dumps({**completion(slow_prompt, slow_seed), "max_tokens": LONG}).encode()

    async def run():
        listening = await start(OpenAIServer(agent, tokenizer, ServerConfig(model_name="m")), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listening.port}/v1/completions"
        loop = asyncio.get_running_loop()
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.setblocking(False)
        try:
            await loop.sock_connect(slow, ("127.0.0.1", listening.port))
            await loop.sock_sendall(slow, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                          b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await until(lambda: agent.in_flight == 1)
            # Both ends' kernel buffers small (the server's would grow to 4 MB): its ~700 kB back the connection up.
            [connection] = listening.runner.server.connections
            connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            async with aiohttp.ClientSession() as session:
                fast = asyncio.create_task(stream_frames(session, url, {**completion(fast_prompt, fast_seed),
                                                                        "max_tokens": LONG}))
                await until(lambda: agent.in_flight == 2)
                for step in range(LONG):
                    consumer.step()         # one token for each stream
                    await until(lambda: sum(polls) == 2 * (step + 1))
                fast_frames = await fast     # served to its end while the slow client read nothing
            assert agent.in_flight == 0
            return fast_frames, await asyncio.wait_for(read_http_chunks(slow), 30)
        finally:
            slow.close()
            await listening.cleanup()

    fast_frames, slow_chunks = asyncio.run(run())
    assert text_of(fast_frames) == expected_text(tokenizer, fast_prompt, fast_seed, LONG)
    events = [e.removeprefix(b"data: ") for chunk in slow_chunks for e in chunk.split(b"\n\n") if e]
    *chunks, usage, done = [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
    assert text_of([chunks]) == expected_text(tokenizer, slow_prompt, slow_seed, LONG), "every token, in order"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
    assert usage["usage"]["completion_tokens"] == LONG
    assert len(slow_chunks) < LONG / 2, "the polls it was behind went out in a few writes once it read"
