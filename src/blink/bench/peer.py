"""The peer: Hugging Face transformers' continuous batching on the same workload, as a benchmark backend.

transformers 5.x offers continuous batching three ways: ``generate_batch`` (offline: every prompt at once, results at
the end), ``transformers serve`` (HTTP; needs the weights on disk and its own server dependencies) and the
``ContinuousBatchingManager`` they are both built on. This backend drives the manager directly: each request is
``add_request(..., streaming=True)`` at its arrival time, and a reader thread stamps every streamed output as it
leaves the manager, so the peer runs the same requests, arrival process and metrics as an HTTP server does — with
no HTTP in its path (which favours the peer). Sampling is greedy, as in the HTTP client; ``ignore_eos`` disables EOS.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from blink.bench.client import CPU_COUNTER
from blink.bench.datasets import SampleRequest
from blink.bench.metrics import RequestOutput

CPU_PAGE_SIZE = 256     # transformers' default KV page (block) size, in tokens


class HFPeer:
    """``async with HFPeer(model_dir, ...) as peer: await peer.send(request)``.

    ``load_format="dummy"`` builds the model from ``config.json`` with random weights (seeded), as blink's engine
    does; ``device=None`` is the GPU when torch sees one; ``dtype=None`` is the checkpoint's on a GPU, float32 on the
    CPU. ``requests`` (the whole workload) sizes the manager, as ``generate_batch`` does with its inputs.
    """

    def __init__(self, model_dir: str, requests: list[SampleRequest], *, load_format: str = "auto",
                 device: str | None = None, dtype: str | None = None, ignore_eos: bool = False, seed: int = 0):
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"--backend hf needs --model to be a model directory with a config.json "
                                    f"(got {model_dir!r})")
        self.model_dir, self.requests, self.load_format = model_dir, requests, load_format
        self.device, self.dtype, self.ignore_eos, self.seed = device, dtype, ignore_eos, seed
        self.manager = None
        self._stack, self._ids, self._waiters = ExitStack(), itertools.count(), {}
        self._stop, self._reader = threading.Event(), None

    def load(self):
        """The model, on ``self.device`` in ``self.dtype``, in eval mode."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        config = AutoConfig.from_pretrained(self.model_dir)
        checkpoint_dtype = str(config.dtype or "float32").removeprefix("torch.")
        self.dtype = self.dtype or (checkpoint_dtype if self.device == "cuda" else "float32")
        dtype = getattr(torch, self.dtype)
        if self.load_format == "dummy":
            torch.manual_seed(self.seed)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype, device_map=self.device)
        return model.eval()

    async def __aenter__(self):
        from transformers.generation import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        model = self.load()
        eos = -1 if self.ignore_eos else model.config.eos_token_id
        generation = GenerationConfig(max_new_tokens=max(r.output_len for r in self.requests), do_sample=False,
                                      eos_token_id=-1 if eos is None else eos, pad_token_id=0)
        hints = WorkloadHints(max_prompt_length=max(r.prompt_len for r in self.requests),
                              max_generated_length=generation.max_new_tokens, num_requests=len(self.requests))
        # On a GPU, transformers sizes its KV cache from free memory and warms up (captures CUDA graphs). On the CPU it
        # would take a share of host memory: a cache for the whole workload is enough there, and warm-up only costs.
        cpu = ContinuousBatchingConfig(num_blocks=sum(-(-(r.prompt_len + r.output_len) // CPU_PAGE_SIZE)
                                                      for r in self.requests))
        self.manager = self._stack.enter_context(model.continuous_batching_context_manager(
            generation_config=generation, workload_hints=hints, warmup=self.device == "cuda",
            continuous_batching_config=None if self.device == "cuda" else cpu))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    async def __aexit__(self, *exc):
        self._stop.set()
        self._reader.join()
        self._stack.close()

    def info(self) -> dict:
        import transformers

        return {"transformers": transformers.__version__, "device": self.device, "dtype": self.dtype,
                "attn_implementation": self.manager.model.config._attn_implementation}

    async def server_counters(self) -> dict[str, float]:
        """This process's CPU time so far (the peer's engine runs here, with the client that times it); transformers
        keeps no other counters."""
        return {CPU_COUNTER: time.process_time()}

    async def send(self, request: SampleRequest) -> RequestOutput:
        """One request through the manager, one chunk per streamed output that adds tokens; never raises."""
        rid = f"bench-{next(self._ids)}"
        updates = asyncio.Queue()
        self._waiters[rid] = (asyncio.get_running_loop(), updates)
        out = RequestOutput(request.prompt_len, start=time.perf_counter())
        try:
            if self.manager.add_request(request.prompt, request_id=rid, max_new_tokens=request.output_len,
                                        streaming=True) is None:
                out.error = "the transformers manager refused the request (it is stopping)"
                return out
            while out.error is None:
                arrived, result = await updates.get()
                if isinstance(result, str) or result.error:
                    out.error = result if isinstance(result, str) else result.error
                elif len(result.generated_tokens) > out.output_tokens:
                    out.chunk_times.append(arrived)
                    out.output_tokens = len(result.generated_tokens)
                if not isinstance(result, str) and result.is_finished():
                    break
        finally:
            del self._waiters[rid]
        if out.error is None and not out.chunk_times:
            out.error = "the request finished without a token"
        return out

    def _read(self) -> None:
        """Reader thread: stamp each output as it leaves the manager and hand it to its request's queue; if the
        generation thread dies, fail every waiting request."""
        while not self._stop.is_set():
            result = self.manager.get_result(timeout=0.1)
            waiter = self._waiters.get(result.request_id) if result is not None else None
            if waiter is not None:
                loop, updates = waiter
                loop.call_soon_threadsafe(updates.put_nowait, (time.perf_counter(), result))
            elif result is None and not self.manager.is_running():
                for loop, updates in list(self._waiters.values()):
                    loop.call_soon_threadsafe(updates.put_nowait, (time.perf_counter(),
                                                                   "the transformers generation thread stopped"))
                self._stop.wait(0.1)
