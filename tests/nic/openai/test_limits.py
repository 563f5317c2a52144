"""blink.nic.openai.limits over HTTP, against the stand-in engine: what a slow or greedy client may hold of the
server (regressions of the adversarial pass: trickling headers, unfinished bodies, huge prompts, bad encodings)."""
import asyncio
import gzip
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from blink.nic.agent import Agent
from blink.nic.openai.errors import ApiError
from blink.nic.openai.limits import RATE_GRACE_S, SMALL_BODY_BYTES, BodyPlaces, HttpLimits
from blink.nic.openai.server import OpenAIServer, ServerConfig, start
from blink.nic.text import Tokenizer
from blink.host.process import wait_until_serving
from blink.ring.geometry import RingGeometry
from blink.ring.reference import standin_engine

LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_pending_bodies=4)
GEOMETRY = RingGeometry(n_slots=8, max_prompt_tokens=256, max_output_tokens=32, max_stop_ids=4, max_model_len=200)


@contextmanager
def serving(limits: HttpLimits, geometry: RingGeometry = GEOMETRY, api_key: str | None = None, step_s: float = 0.0):
    """``(server, port)``: the HTTP server on a background event loop, over the stand-in engine (a step every
    ``step_s``)."""
    from blink.models import default_model_path

    tokenizer = Tokenizer(default_model_path())
    with standin_engine(geometry, vocab_size=tokenizer.vocab_size, step_s=step_s) as (memory, process):
        agent = Agent(memory, geometry)
        wait_until_serving(agent, process)
        served = OpenAIServer(agent, tokenizer, ServerConfig(model_name="m", limits=limits, api_key=api_key))
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        listening = asyncio.run_coroutine_threadsafe(start(served, "127.0.0.1", 0), loop).result()
        yield served, listening.port
        asyncio.run_coroutine_threadsafe(listening.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def server():
    with serving(LIMITS) as served:
        yield served


def connect(port, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(timeout_s)
    return sock


def receive(sock) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def post(port, body: bytes, headers: str = "", path="/v1/completions", timeout_s: float = 10.0) -> tuple[int, dict]:
    with connect(port, timeout_s) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
        head, _, payload = receive(sock).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def completion(prompt, **fields) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 4, **fields}).encode()


def large(body: bytes) -> bytes:
    """``body`` padded with JSON whitespace beyond ``SMALL_BODY_BYTES``: a body that needs a place."""
    return body + b" " * (SMALL_BODY_BYTES + 1 - len(body))


def trickle(port, declared: int, every_s: float, stop: threading.Event) -> bytes:
    """A request whose body of ``declared`` bytes comes one byte per ``every_s`` until ``stop`` or the server's
    answer; the answer."""
    with connect(port) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode())
        sock.settimeout(every_s)
        for _ in range(declared):
            if stop.is_set():
                return b""
            try:
                sock.send(b" ")
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return b""
            sock.settimeout(10)
            return answer + (receive(sock) if answer else b"")
        return b""


def one_response(sock) -> tuple[bytes, dict]:
    """One response of a kept-alive connection: its status line and its JSON body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"the connection closed after {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail("the connection closed mid-body")
    return head.split(b"\r\n")[0], json.loads(body)


def sent_in_pieces(port, body: bytes, pause_s: float) -> bool:
    """Whether ``body``, sent in 4 pieces ``pause_s`` apart, is served."""
    size = len(body) // 4 + 1
    with connect(port) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), size):
            time.sleep(pause_s)
            sock.sendall(body[i:i + size])
        return one_response(sock)[0].startswith(b"HTTP/1.1 200")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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


def test_a_large_body_beyond_the_cap_waits_for_a_place_and_is_served(server):
    """Stalled large bodies hold every place; a whole large request that comes after them waits (it is not refused)
    and is served once their body timeout frees the places."""
    _, port = server
    stalled = [connect(port) for _ in range(LIMITS.max_pending_bodies)]
    for sock in stalled:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {SMALL_BODY_BYTES + 1}\r\n\r\n{{"
                     .encode())
    time.sleep(0.5)
    start = time.monotonic()
    assert post(port, large(completion("hello")))[0] == 200
    assert time.monotonic() - start > 0.3, "it waited for a stalled body's place"
    for sock in stalled:
        assert receive(sock).startswith(b"HTTP/1.1 408")
        sock.close()


def test_slow_bodies_make_no_other_request_wait(server):
    """Regression: 64 bodies trickling one byte a second made every other request wait ~28 s: they held every place
    for their whole body timeout. A small body takes no place, and a large one that holds a place must keep arriving
    at min_body_rate: while small and large bodies trickle, a normal request of either size is answered, and the
    large trickles are refused with 408 (a large body that keeps coming is not)."""
    limits = HttpLimits(max_pending_bodies=4, body_timeout_s=20.0)
    with serving(limits) as (_, port), ThreadPoolExecutor(2 * limits.max_pending_bodies) as pool:
        stop = threading.Event()
        declared = [1000] * limits.max_pending_bodies + [SMALL_BODY_BYTES + 1] * limits.max_pending_bodies
        slow = [pool.submit(trickle, port, n, 0.2, stop) for n in declared]
        time.sleep(0.5)                     # they have what they can get: the old code gave them every place
        for body in (completion("hello"), large(completion("hello"))):
            start = time.monotonic()
            assert post(port, body)[0] == 200
            assert time.monotonic() - start < limits.body_timeout_s / 4, "it waited for the trickles"
        assert sent_in_pieces(port, large(completion("hello")), RATE_GRACE_S / 8)
        stop.set()
        answers = [future.result() for future in slow]
    for answer in answers[limits.max_pending_bodies:]:
        assert answer.startswith(b"HTTP/1.1 408") and b"slower than 65536 bytes a second" in answer


def test_a_request_head_over_max_head_bytes_gets_a_json_431(server):
    _, port = server
    padding = ("X-Pad: " + "a" * 8000 + "\r\n").encode() * (2 * LIMITS.max_head_bytes // 8000)
    with connect(port) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + padding)
        status, body = one_response(sock)
    assert status.startswith(b"HTTP/1.1 431") and "request head" in body["error"]["message"]


def test_unfinished_request_heads_hold_bounded_memory(server):
    """Regression: 1,000 connections sending ~1 MB request heads they never finish took the agent from 0.6 to
    2.0 GB (aiohttp takes 128 headers of 8 KB). A head is cut at max_head_bytes, so the agent's memory grows by about
    that much per connection (here the server's process is this one)."""
    served, port = server
    n, head = 100, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + ("X-Pad: " + "a" * 8000 + "\r\n").encode() * 64
    before, refused = rss_bytes(), served.guard.closed_big
    socks = [connect(port) for _ in range(n)]
    try:
        for sock in socks:
            sock.sendall(head)                   # 512 KB each, no blank line
        time.sleep(0.5)
        grown = rss_bytes() - before
        assert grown < n * 4 * LIMITS.max_head_bytes + (16 << 20), f"{grown / 2**20:.0f} MiB for {n} heads"
        assert served.guard.closed_big - refused == n
    finally:
        for sock in socks:
            sock.close()


def test_an_idle_kept_alive_connection_outlives_the_header_timeout(server):
    """Regression: the head's clock ran while a kept-alive connection waited for its next request, closing it at
    header_timeout_s (10 s) against keepalive_timeout_s (15 s, as documented); it starts at the head's first byte."""
    _, port = server
    with connect(port) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert one_response(sock) == (b"HTTP/1.1 200 OK", {"status": "ok"})
            time.sleep(LIMITS.header_timeout_s + 0.5)


@pytest.mark.parametrize("raw,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n", 400),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n", 413),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: foo\r\nContent-Length: 2\r\n\r\n{}", 415),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}", 415),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
])
def test_every_http_error_is_openai_error_json(server, raw, status):
    """Regression: aiohttp's own errors (malformed HTTP, a Content-Encoding it cannot decode) were plain text, and
    an unknown Content-Encoding was read as if plain."""
    with connect(server[1]) as sock:
        sock.sendall(raw)
        head, body = one_response(sock)
    assert int(head.split()[1]) == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_the_bearer_scheme_is_case_insensitive():
    """RFC 7235: 'bearer KEY' is 'Bearer KEY' (it was a 401); the key itself is compared exactly."""
    with serving(LIMITS, api_key="sesame") as (_, port):
        for scheme, key, status in [("Bearer", "sesame", 200), ("bearer", "sesame", 200), ("BEARER", "sesame", 200),
                                    ("bearer", "Sesame", 401), ("Basic", "sesame", 401), ("bearer", "", 401)]:
            with connect(port) as sock:
                sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: {scheme} {key}\r\n\r\n"
                             .encode())
                assert one_response(sock)[0].split()[1] == str(status).encode(), (scheme, key)
        with connect(port) as sock:
            # Refused before all its body came: the connection closes after the answer (the guard counts the next
            # head from the first byte after a response, which must not be the rest of this body).
            body = completion("hello")
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body) + 10}\r\n\r\n"
                         .encode() + body)
            assert one_response(sock)[0].split()[1] == b"401"
            sock.sendall(b" " * 10)             # the rest, which aiohttp reads and drops: it would keep the connection
            assert sock.recv(1) == b""


def test_a_burst_of_requests_beyond_the_cap_is_queued_not_refused(server):
    """Regression: 128 requests at once against a cap of 64 bodies got 40 answers of 503."""
    _, port = server
    with ThreadPoolExecutor(6 * LIMITS.max_pending_bodies) as pool:
        answers = list(pool.map(lambda i: post(port, large(completion(f"hello {i}"))),
                                range(6 * LIMITS.max_pending_bodies)))
    assert [status for status, _ in answers] == [200] * len(answers)


def test_a_body_that_finds_no_place_by_its_deadline_gets_503():
    async def scenario():
        loop = asyncio.get_running_loop()
        guard, release = BodyPlaces(HttpLimits(max_pending_bodies=2)), asyncio.Event()

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
    gaps = []
    big = [threading.Thread(target=post, args=(port, completion(text))) for _ in range(8)]
    for thread in big:
        thread.start()
    streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(port, 30)))
    streamer.start()
    for thread in [*big, streamer]:
        thread.join(60)
    assert not streamer.is_alive() and gaps and max(gaps) < 1.0, gaps


def stream_gaps(port, max_tokens: int) -> list[float]:
    """The seconds between the chunks of a streamed completion of ``max_tokens`` tokens."""
    gaps = []
    with connect(port) as sock:
        body = completion("a", max_tokens=max_tokens, stream=True, ignore_eos=True)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        last = time.monotonic()
        while sock.recv(65536):
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
    return gaps


def test_long_prompts_being_tokenized_neither_stall_streams_nor_make_small_chats_wait():
    """Regression: 16 prompts near the body cap froze other streams for 3.7-9.9 s (the tokenizer held the GIL) and
    made small chats wait 21 s (one queue for every tokenizer thread). Encoding lets go of the GIL and small bodies
    have a tokenizer thread of their own: while 8 long prompts are tokenized (a ring of 8,192 prompt tokens, so that
    each is ~660 KB of text, seconds of tokenizer), a stream's chunks keep coming and a small chat is answered in a
    small part of the time the long prompts take."""
    geometry = RingGeometry(n_slots=8, max_prompt_tokens=8192, max_output_tokens=32, max_stop_ids=4,
                            max_model_len=8300)
    with serving(HttpLimits(max_pending_bodies=8), geometry, step_s=0.1) as (served, port), \
            ThreadPoolExecutor(9) as pool:
        longest = min(served.parser.max_text_bytes, served.config.limits.max_body_bytes - 100)
        text = "word " * (longest // 5)                             # as long as is still tokenized
        start = time.monotonic()
        # One tokenizer thread takes them in turn: seconds each on a busy machine.
        longs = [pool.submit(post, port, completion(text), timeout_s=300) for _ in range(8)]
        time.sleep(0.5)                                             # they are read and being tokenized
        streaming = pool.submit(stream_gaps, port, 30)
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        asked = time.monotonic()
        assert post(port, chat, path="/v1/chat/completions")[0] == 200
        chat_s = time.monotonic() - asked
        assert [future.result()[0] for future in longs] == [400] * 8       # tokenized, then too many tokens
        longs_s = time.monotonic() - start
        gaps = streaming.result()
    assert chat_s < longs_s / 4, (chat_s, longs_s)
    assert max(gaps) < 1.0, (max(gaps), longs_s)


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
