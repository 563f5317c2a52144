"""blink.nic.openai.limits over HTTP, against the stand-in engine: what a slow or greedy client may hold of the
server (regressions of the adversarial pass: trickling headers, unfinished bodies, huge prompts, bad encodings)."""
import asyncio
import gzip
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from blink.nic.agent import Agent
from blink.nic.openai.errors import ApiError
from blink.nic.openai.limits import ConnectionGuard, HttpLimits
from blink.nic.openai.server import OpenAIServer, ServerConfig, start
from blink.nic.text import Tokenizer
from blink.process import wait_until_serving
from blink.ring.geometry import RingGeometry
from blink.ring.reference import standin_engine

LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_pending_bodies=4)
GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=256, max_output_tokens=32, max_stop_ids=4, max_model_len=200)


@pytest.fixture(scope="module")
def server():
    from blink.models import default_model_path

    tokenizer = Tokenizer(default_model_path())
    with standin_engine(GEOMETRY, vocab_size=tokenizer.vocab_size) as (memory, process):
        agent = Agent(memory, GEOMETRY)
        wait_until_serving(agent, process)
        served = OpenAIServer(agent, tokenizer, ServerConfig(model_name="m", limits=LIMITS))
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        listening = asyncio.run_coroutine_threadsafe(start(served, "127.0.0.1", 0), loop).result()
        yield served, listening.port
        asyncio.run_coroutine_threadsafe(listening.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)


def connect(port) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


def receive(sock) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def post(port, body: bytes, headers: str = "", path="/v1/completions") -> tuple[int, dict]:
    with connect(port) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
        head, _, payload = receive(sock).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def completion(prompt, **fields) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 4, **fields}).encode()


def test_a_client_trickling_its_headers_is_disconnected(server):
    served, port = server
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert receive(sock) == b"", "the connection is closed without an answer"
        assert LIMITS.header_timeout_s - 0.1 < time.monotonic() - start < LIMITS.header_timeout_s + 2
    assert served.guard.closed_slow >= 1


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    _, port = server
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        answer = receive(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer


def test_a_body_beyond_the_cap_waits_for_a_place_and_is_served(server):
    """Stalled bodies hold every place; a whole request that comes after them waits (it is not refused) and is
    served once their body timeout frees the places."""
    _, port = server
    stalled = [connect(port) for _ in range(LIMITS.max_pending_bodies)]
    for sock in stalled:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    time.sleep(0.5)
    start = time.monotonic()
    assert post(port, completion("hello"))[0] == 200
    assert time.monotonic() - start > 0.3, "it waited for a stalled body's place"
    for sock in stalled:
        assert receive(sock).startswith(b"HTTP/1.1 408")
        sock.close()


def test_a_burst_of_requests_beyond_the_cap_is_queued_not_refused(server):
    """Regression: 128 requests at once against a cap of 64 bodies got 40 answers of 503."""
    _, port = server
    with ThreadPoolExecutor(6 * LIMITS.max_pending_bodies) as pool:
        answers = list(pool.map(lambda i: post(port, completion(f"hello {i}")), range(6 * LIMITS.max_pending_bodies)))
    assert [status for status, _ in answers] == [200] * len(answers)


def test_a_body_that_finds_no_place_by_its_deadline_gets_503():
    async def scenario():
        loop = asyncio.get_running_loop()
        guard, release = ConnectionGuard(HttpLimits(max_pending_bodies=2)), asyncio.Event()

        async def hold(deadline):
            async with guard.receiving(deadline):
                await release.wait()

        holders = [asyncio.create_task(hold(loop.time() + 10)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            async with guard.receiving(loop.time() + 0.05):
                pass
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert "all 2 places for a request body being received were taken for 30 s" in refused.value.message
        waiter = asyncio.create_task(hold(loop.time() + 10))       # time left: it gets the first place given back
        await asyncio.sleep(0.05)
        assert not waiter.done()
        release.set()
        await asyncio.gather(*holders, waiter)
        async with guard.receiving(loop.time()):                    # every place is free again
            pass

    asyncio.run(scenario())


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server):
    """Regression: a 1 MB prompt was tokenized on the event loop before the length check (~0.5 s each)."""
    served, port = server
    text = "word " * (served.parser.max_text_bytes // 5 + 10)
    start = time.monotonic()
    status, body = post(port, completion(text))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "bytes, which cannot fit" in body["error"]["message"] and time.monotonic() - start < 0.5


def test_token_id_prompts_are_parsed_on_the_event_loop_and_text_in_a_tokenizer_thread(server):
    """A prompt of token ids needs no tokenizer: it is parsed where the request arrived, without a round trip to a
    worker thread (two wake-ups per request); text prompts, chat messages and over-long id lists go to the threads."""
    served, port = server
    where = []

    def recorded(parse):
        def run(body):
            where.append(threading.current_thread().name.startswith("blink-tokenizer"))
            return parse(body)
        return run

    served.parser.completion, served.parser.chat = recorded(served.parser.completion), recorded(served.parser.chat)
    try:
        assert post(port, completion([1, 2, 3]))[0] == 200
        assert post(port, completion([[4, 5]]))[0] == 200
        assert post(port, completion("hello"))[0] == 200
        assert post(port, completion(["hello"]))[0] == 200
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        assert post(port, chat, path="/v1/chat/completions")[0] == 200
        status, body = post(port, completion([1] * (served.parser.max_prompt + 1)))
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    finally:
        del served.parser.completion, served.parser.chat       # the class's methods again
    assert where == [False, False, True, True, True, True]


def test_tokenizing_long_prompts_does_not_stall_another_stream(server):
    """Regression: 16 concurrent 1 MB prompts stalled an unrelated stream for 7.8 s; tokenizing now runs in worker
    threads, so the event loop keeps streaming while they are tokenized."""
    served, port = server
    text = "x" * (served.parser.max_text_bytes - 10)      # the longest that is still tokenized (then refused)
    gaps, done = [], threading.Event()

    def stream():
        with connect(port) as sock:
            body = completion("a", max_tokens=30, stream=True, ignore_eos=True)
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            last = time.monotonic()
            while sock.recv(65536):
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
        done.set()

    big = [threading.Thread(target=post, args=(port, completion(text))) for _ in range(8)]
    for thread in big:
        thread.start()
    streamer = threading.Thread(target=stream)
    streamer.start()
    for thread in [*big, streamer]:
        thread.join(60)
    assert done.is_set() and max(gaps) < 1.0, max(gaps)


def test_over_the_engines_max_model_len_is_a_400_naming_it(server):
    status, body = post(server[1], completion([5] * 190, max_tokens=20))
    assert status == 400 and "max_model_len is 200" in body["error"]["message"]
    assert body["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("value,status", [(1e308, 400), (3e38, 200), (1e-39, 200), (float("inf"), 400)])
def test_temperatures_at_the_limits_of_float32(server, value, status):
    payload = json.dumps({"prompt": "a", "max_tokens": 2, "temperature": value}, allow_nan=True).encode()
    got, body = post(server[1], payload)
    assert got == status, body


def test_a_body_that_is_not_the_gzip_it_says_gets_400_and_real_gzip_works(server):
    _, port = server
    status, body = post(port, completion("hello"), "Content-Encoding: gzip\r\n")
    assert status == 400 and "could not be read" in body["error"]["message"]
    assert post(port, gzip.compress(completion("hello")), "Content-Encoding: gzip\r\n")[0] == 200


def test_malformed_http_is_logged_in_one_line(server, caplog):
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        with connect(server[1]) as sock:
            sock.sendall(b"GARBAGE\r\n\r\n")
            assert receive(sock).startswith(b"HTTP/1.0 400")
        time.sleep(0.2)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.exc_info is None and "\n" not in r.getMessage().strip() for r in records)


def test_limits_are_validated_by_name():
    with pytest.raises(ValueError, match="HttpLimits.header_timeout_s"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="HttpLimits.max_pending_bodies"):
        HttpLimits(max_pending_bodies=0)
