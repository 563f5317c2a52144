"""Tensor-parallel ranks of the CPU engine: rank 0 schedules, every other rank runs rank 0's plan on its shard.

``EngineConfig.tensor_parallel_size = N`` serves one model over N processes joined by a gloo process group on
loopback. Rank 0 is the engine: it owns the ring and the scheduler, and holds its shard of the model
(``blink.models.parallel``). Ranks 1..N-1 are ``follow`` processes it starts: each loads its own shard, allocates a
KV pool, token history and step buffers of rank 0's sizes (``Setup``) and then loops on one message per step. A
follower is a plain subprocess (``python -m blink.ranks SHARD``), so a daemonic engine process may start it; when
rank 0's process ends, the group's connections close and the follower's next collective fails, which ends it.

Per step, rank 0 broadcasts a header ``[op, num_tokens]`` and, for a step, every step input (``PLAN_FIELDS``: the
step buffers but the sampled outputs), then every rank runs the same model step. The model's all-reduces give every
rank the same logits bit for bit (``parallel.py``'s invariant). Every rank's KV pool and token history take the
plan's tokens (``token_ids``), so they hold the same contents; a follower's sampled outputs are never read, and only
rank 0's reach the ring. The followers never read the ring and never decide anything: there is one plan, so the
ranks cannot diverge.

Hence what shapes only the sampling needs rank 0 alone. Structured outputs: rank 0 masks its grammar rows' logits
with its scheduler's mirror of the ring's grammars region, as at size 1; a follower steps without the region (it
samples those rows unmasked, and nobody reads what it sampled), so no grammar crosses the group.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict, astuple, dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist

from blink.device.step import StepBuffers, StepLayout
from blink.errors import EngineError

OP_STEP, OP_STOP = 1, 2
PLAN_FIELDS = tuple(name for name in StepLayout().fields() if not name.startswith("sampled_"))
LOAD_TIMEOUT_S = 600          # a follower loads its shard (random weights of large shapes take a while on a CPU)
STOP_TIMEOUT_S = 30
LOAD_POLL_S = 0.1
log = logging.getLogger("blink")


@dataclass(frozen=True)
class Setup:
    """The sizes rank 0 chose, which every follower allocates: KV pages of ``page_size`` tokens, then the step
    layout's fields in ``StepLayout``'s order (``Setup(pages, page_size, *astuple(layout))``)."""

    num_pages: int
    page_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_pages_per_seq: int
    max_logit_bias: int
    max_top_logprobs: int
    decode_query_len: int

    def layout(self) -> StepLayout:
        return StepLayout(self.max_num_batched_tokens, self.max_num_seqs, self.max_pages_per_seq,
                          self.max_logit_bias, self.max_top_logprobs, self.decode_query_len)


@dataclass(frozen=True)
class Shard:
    """What a follower loads: rank ``rank`` of ``world_size`` of the model directory ``model_dir`` (random weights
    when ``dummy``) in ``dtype``, quantized at load as ``quantization`` asks, its KV pool in ``kv_cache_dtype``
    (``EngineConfig``'s, as rank 0's); the group's rendezvous is ``127.0.0.1:port``."""

    model_dir: str
    dummy: bool
    dtype: str
    world_size: int
    rank: int
    port: int
    quantization: str | None
    kv_cache_dtype: str


def load(model_dir: str, dummy: bool, dtype: str, device: str, tp, quantization: str | None = None):
    """Rank ``tp.rank``'s part of the model (all of it at world size 1): random weights when ``dummy``, else the
    directory's checkpoint; ``quantization="fp8"`` quantizes it at load (``load_model``). The ranks' all-reduces use
    the default process group."""
    from blink.models import ModelConfig, load_model, random_model
    from blink.models.quantization import requested

    if dummy:
        config = requested(ModelConfig.from_file(model_dir), quantization)
        return random_model(config, device=device, dtype=dtype, tp=tp)
    return load_model(model_dir, device=device, dtype=dtype, tp=tp, quantization=quantization)


def _join(store, shard: Shard) -> None:
    dist.init_process_group("gloo", store=store, rank=shard.rank, world_size=shard.world_size,
                            timeout=timedelta(seconds=LOAD_TIMEOUT_S))


def _broadcast_ints(values: list[int]) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def follow(shard: Shard) -> None:
    """A follower's process: load the shard, say so, join the group, allocate rank 0's sizes, run its plans."""
    from blink.models import TensorParallel
    from blink.models.history import TokenHistory
    from blink.models.memory import kv_cache_dtype
    model = load(shard.model_dir, shard.dummy, shard.dtype, "cpu", TensorParallel(shard.world_size, shard.rank),
                 shard.quantization)
    store = dist.TCPStore("127.0.0.1", shard.port, shard.world_size, is_master=False,
                          timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    store.set(f"loaded/{shard.rank}", "1")
    _join(store, shard)
    try:
        setup = Setup(*_broadcast_ints([0] * len(fields(Setup))))
        kv_dtype = kv_cache_dtype(shard.kv_cache_dtype, model.dtype)
        kv = model.allocate_kv_cache(setup.num_pages, setup.page_size, kv_dtype)
        step = StepBuffers(setup.layout())
        history = TokenHistory.allocate(setup.num_pages, setup.page_size, TokenHistory.scratch(
            setup.max_num_seqs, model.lm_head_weight().shape[0], "cpu"))
        while True:
            op, num_tokens = _broadcast_ints([0, 0])
            if op == OP_STOP:
                return
            for name in PLAN_FIELDS:
                dist.broadcast(getattr(step, name), src=0)
            model(step, kv, num_tokens, history)     # no grammars region: what it samples is never read
    finally:
        dist.destroy_process_group()


class Followers:
    """Rank 0's side: ``start`` the followers before loading rank 0's shard, ``share`` the sizes once rank 0's
    pool exists, ``run`` each step's plan before rank 0 runs it, ``stop`` at the end."""

    def __init__(self, store, processes):
        self._store, self._processes = store, processes

    @classmethod
    def start(cls, model_dir: str, dummy: bool, dtype: str, world_size: int, quantization: str | None,
              kv_cache_dtype: str) -> Followers:
        """Start ranks 1..world_size-1 and join the group with them once every one has loaded its shard."""
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=LOAD_TIMEOUT_S),
                              wait_for_workers=False)
        shards = [Shard(model_dir, dummy, dtype, world_size, rank, store.port, quantization, kv_cache_dtype)
                  for rank in range(world_size)]
        processes = [subprocess.Popen([sys.executable, "-m", "blink.ranks", json.dumps(asdict(shard))])
                     for shard in shards[1:]]
        followers = cls(store, processes)
        try:
            followers._wait_loaded()
            _join(store, shards[0])
        except BaseException:
            followers.kill()
            raise
        log.info("tensor parallel: %d ranks on the CPU (gloo), rank 0 schedules", world_size)
        return followers

    def _wait_loaded(self) -> None:
        """Until every follower has loaded its shard; ``EngineError`` naming the first that exited instead."""
        for rank, process in enumerate(self._processes, start=1):
            while not self._store.check([f"loaded/{rank}"]):
                if process.poll() is not None:
                    raise EngineError(f"tensor-parallel rank {rank} exited with code {process.returncode} while "
                                      "loading its shard (its error is above)")
                time.sleep(LOAD_POLL_S)

    def share(self, setup: Setup) -> None:
        _broadcast_ints(list(astuple(setup)))

    def run(self, step: StepBuffers, num_tokens: int) -> None:
        """Send one step's plan: the followers run it as rank 0 does."""
        _broadcast_ints([OP_STEP, num_tokens])
        for name in PLAN_FIELDS:
            dist.broadcast(getattr(step, name), src=0)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def stop(self, clean: bool) -> None:
        """End the followers (``clean``: tell them through the group; else, after a failed step, kill them)."""
        if clean:
            _broadcast_ints([OP_STOP, 0])
            for process in self._processes:
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass                    # killed below
        self.kill()

    def kill(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    follow(Shard(**json.loads(sys.argv[1])))
