"""The HTTP server and its engine in one event loop, for tests that must stop and start the engine at will: the ring
is in-process (``LocalMemory``) and the engine is the reference consumer (the stand-in model), stepped by a task of
that loop while ``Local.engine_runs`` is set. Clear it and the GPU side stalls (its heartbeat stands still); set it
and the requests go on. Clients are aiohttp sessions on the same loop."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp

from blink.nic.agent_loop import LoopConfig
from blink.nic.drain import DrainConfig
from blink.nic.openai.server import OpenAIServer, ServerConfig, start
from blink.nic.text import Tokenizer
from blink.ring import control
from blink.ring.control import ENGINE_SERVING
from blink.ring.geometry import RingGeometry
from blink.ring.reference import ReferenceConsumer

GEOMETRY = RingGeometry(n_slots=4, max_prompt_tokens=32, max_output_tokens=16, max_stop_ids=4, max_model_len=48)


@dataclass
class Local:
    server: OpenAIServer
    consumer: ReferenceConsumer
    memory: object
    port: int
    session: aiohttp.ClientSession
    engine_runs: asyncio.Event = field(default_factory=asyncio.Event)

    def serve(self) -> None:
        """The engine reports it serves (what the reference consumer's ``run()`` does first) and starts stepping."""
        control.write(self.memory, "engine_state", ENGINE_SERVING)
        self.engine_runs.set()

    async def get(self, path: str) -> tuple[int, dict]:
        async with self.session.get(f"http://127.0.0.1:{self.port}{path}") as response:
            return response.status, await response.json()

    async def complete(self, stream: bool = False, max_tokens: int = 8) -> tuple[int, dict, str]:
        """A completion of a fixed prompt: status, headers, body (SSE text when streamed)."""
        body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
        async with self.session.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body) as response:
            return response.status, dict(response.headers), await response.text()

    async def metrics(self) -> dict[str, float]:
        async with self.session.get(f"http://127.0.0.1:{self.port}/metrics") as response:
            text = await response.text()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}

    async def until(self, condition, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.005)


def finished(answer: tuple[int, dict, str], stream: bool = False) -> bool:
    """``Local.complete``'s answer in full: 200, every token, and for a stream the closing ``[DONE]``, no error."""
    status, _, body = answer
    if status != 200:
        return False
    if stream:
        return body.endswith("data: [DONE]\n\n") and '"error"' not in body
    return json.loads(body)["choices"][0]["finish_reason"] == "length"


@asynccontextmanager
async def local_server(local_ring, tokenizer: Tokenizer, *, max_queued: int = 2, drain_timeout_s: float = 30.0,
                       liveness_timeout_s: float = 10.0, model_name: str = "local"):
    """A server on an in-process ring whose engine has not started yet (call ``Local.serve()``)."""
    memory, agent, consumer = local_ring(GEOMETRY, liveness_timeout_s=liveness_timeout_s)
    config = ServerConfig(model_name=model_name, loop=LoopConfig(max_queued=max_queued),
                          drain=DrainConfig(timeout_s=drain_timeout_s))
    server = OpenAIServer(agent, tokenizer, config)
    listening = await start(server, "127.0.0.1", 0)
    async with aiohttp.ClientSession() as session:
        local = Local(server, consumer, memory, listening.port, session)
        engine = asyncio.create_task(_step(local))
        try:
            yield local
        finally:
            engine.cancel()
            await listening.cleanup()


def run_local(local_ring, tokenizer: Tokenizer, scenario, *, serve: bool = False, **options) -> None:
    """Run ``await scenario(local)`` against a ``local_server(**options)``, its engine serving first if ``serve``;
    a scenario that hangs fails after 30 s."""
    async def main():
        async with local_server(local_ring, tokenizer, **options) as local:
            if serve:
                local.serve()
                await asyncio.sleep(0.15)           # the loop has seen the engine serve
            async with asyncio.timeout(30):
                await scenario(local)
    asyncio.run(main())


async def _step(local: Local) -> None:
    while True:
        await local.engine_runs.wait()
        local.consumer.step()
        await asyncio.sleep(0.001)
