"""``blink.ranks``: a CPU engine whose model is split over two processes serves what the unsplit engine serves (greedy
tokens equal, logprobs within float32 reordering), with rank 0's plan run by rank 1 through chunked prefill and
batches that mix prefills and decodes, also from an engine in a process of its own, and structured outputs (JSON
schemas, greedy and seeded, each answer valid); a killed engine leaves no rank behind; sizes that do not split, a
rank that cannot load and a GPU engine are refused by name."""
import json
import os
import shutil
import time
import uuid
from dataclasses import replace

import pytest
import torch

from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig
from blink.bench.shapes import write_model_dir
from blink.errors import ConfigError, EngineError
from blink.models import TensorParallel, load_model
from blink.models.e4m3 import FP8
from tests.models.harness import greedy_continuations, tiny_hf_model
from tests.models.parallel_run import assembled
from tests.processes import children

# A 16-token step budget splits the 40-token prompt into chunks that share steps with the others' decodes.
CONFIG = EngineConfig(device="cpu", n_slots=8, max_prompt_tokens=48, max_output_tokens=16, sim_threads=2,
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=64,
                                                max_model_len=64))
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny_hf_model's Qwen3: 4 query heads, 2 KV heads, so two ranks hold 2 and 1."""
    path = tmp_path_factory.mktemp("tp-engine") / "qwen3"
    tiny_hf_model("Qwen3ForCausalLM", head_dim=32).save_pretrained(path)
    return str(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 20, 40, 9)]


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has: nobody may be left to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def serve(config: EngineConfig) -> tuple[list, list[int], int]:
    """Outputs of ``prompts()``, the followers' pids (each checked alive while the engine ran) and the query heads
    of the model in this process."""
    with Engine(config) as engine:
        outputs = engine.generate(prompts(), GREEDY)
        followers = engine.core.backend.followers
        pids = followers.pids if followers is not None else []
        assert all(running(pid) for pid in pids)
        heads = engine.core.backend.model.local_config.num_heads
    return outputs, pids, heads


def test_two_ranks_serve_what_one_does(model_dir):
    want, _, full_heads = serve(replace(CONFIG, model=model_dir))
    got, pids, heads = serve(replace(CONFIG, model=model_dir, tensor_parallel_size=2))
    assert (full_heads, heads) == (4, 2) and len(pids) == 1    # rank 0 held half, rank 1 ran beside it
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=1e-5)
    assert not running(pids[0])                                # stopped with the engine


def test_two_ranks_serve_fp8_as_their_shards_put_together(model_dir):
    """``--quantization fp8`` and an FP8 KV cache over two ranks: each rank, the follower too, quantizes its shard
    and keeps its KV heads in e4m3; the greedy tokens are those of the model of the two shards put together, over
    an e4m3 pool."""
    config = replace(CONFIG, model=model_dir, tensor_parallel_size=2, quantization="fp8", kv_cache_dtype="fp8")
    got, pids, _ = serve(config)
    shards = [load_model(model_dir, dtype=torch.float32, tp=TensorParallel(2, rank), quantization="fp8")
              for rank in range(2)]
    reference = assembled(load_model(model_dir, dtype=torch.float32), shards)
    assert len(pids) == 1
    assert [o.token_ids for o in got] == greedy_continuations(reference, prompts(), GREEDY.max_tokens, FP8)


def test_random_weights_split_the_same_way(model_dir):
    dummy = replace(CONFIG, model=model_dir, load_format="dummy")
    want, _, _ = serve(dummy)
    got, _, _ = serve(replace(dummy, tensor_parallel_size=2))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


GRAMMAR_ROOM = 16 << 10     # the largest grammar below fits, not all: a grammar is placed over words another held
STRUCTURED = replace(CONFIG, load_format="dummy", max_output_tokens=96, max_grammar_bytes=GRAMMAR_ROOM,
                     scheduler=replace(CONFIG.scheduler, num_pages=160, max_model_len=144))


def serve_structured(config: EngineConfig, schemas: list[dict]) -> tuple[list, list[int]]:
    """Every one of ``schemas`` asked greedily, then seeded (all submitted at once, ``max_num_seqs`` in flight),
    and the bytes of their grammars."""
    from blink.nic.grammars import StructuredOutputs

    with Engine(config) as engine:
        grammars = [engine.grammar(StructuredOutputs.json(schema)) for schema in schemas]
        most = config.max_output_tokens
        params = [SamplingParams(max_tokens=most, temperature=0, grammar=g) for g in grammars]
        params += [SamplingParams(max_tokens=most, temperature=1.0, seed=k, grammar=g) for k, g in enumerate(grammars)]
        outputs = engine.generate([prompts()[k % 4] for k in range(len(params))], params)
    return outputs, [g.nbytes for g in grammars]


def test_two_ranks_answer_structured_outputs_as_one_does(tmp_path):
    """Rank 0 masks each grammar row's logits with its scheduler's mirror of the grammars region; the followers step
    without one (their sampled tokens are never read: every rank's KV pool and token history take the plan's
    tokens). On random weights over a byte-level vocabulary, with several schemas in flight and a region that
    holds only some of their grammars at once: the two-rank engine's answers are the one-rank engine's, token for
    token, and each parses and follows its schema."""
    # Not on the GPU image, where this module is collected: imported here.
    import jsonschema

    from tests.nic.openai.test_structured import HAND_WRITTEN      # imports openai

    schemas = HAND_WRITTEN[1:]      # every value bounded (not the first's integer): random weights end an answer
    config = replace(STRUCTURED, model=str(write_model_dir(tmp_path / "bytes", "tiny-qwen3", "bytes")))
    want, sizes = serve_structured(config, schemas)
    got, _ = serve_structured(replace(config, tensor_parallel_size=2), schemas)
    assert max(sizes) <= GRAMMAR_ROOM < sum(sizes)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out, schema in zip(got, schemas * 2, strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_a_size_that_does_not_split_is_refused_by_field(model_dir):
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) must be a multiple of the tensor parallel size"):
        Engine(replace(CONFIG, model=model_dir, tensor_parallel_size=3))


def test_a_rank_that_cannot_load_its_shard_is_named(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(f"{model_dir}/config.json", broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EngineError, match=r"tensor-parallel rank 1 exited with code 1 while loading its shard"):
        Engine(replace(CONFIG, model=str(broken), tensor_parallel_size=2))


@pytest.mark.gpu
def test_the_gpu_engine_refuses_tensor_parallelism_until_it_has_a_scheduler_per_gpu(model_dir):
    with pytest.raises(EngineError, match=r"tensor_parallel_size=2 runs on the CPU only so far"):
        Engine(replace(CONFIG, model=model_dir, device="cuda", tensor_parallel_size=2))


def test_an_engine_in_a_process_of_its_own_starts_its_ranks(model_dir):
    """``blink serve`` runs the engine in a daemonic process, which may not have multiprocessing children: the
    followers are plain subprocesses. Through the ring, the two-rank engine answers as the one-rank one does."""
    from blink.nic.agent import Agent
    from blink.host.process import engine_process, wait_until_serving

    want, _, _ = serve(replace(CONFIG, model=model_dir))
    config = replace(CONFIG, model=model_dir, tensor_parallel_size=2, ring_name=f"blink-test-tp-{uuid.uuid4().hex[:8]}")
    with engine_process(config) as (memory, process):
        agent = Agent.attach(memory)
        wait_until_serving(agent, process)
        tokens = {agent.submit(prompt, GREEDY): [] for prompt in prompts()}
        while agent.in_flight:
            for out in agent.poll():
                tokens[out.request_id] += out.new_tokens
            time.sleep(0.01)
    assert list(tokens.values()) == [o.token_ids for o in want]


def test_a_killed_engine_leaves_no_rank_behind(model_dir):
    """SIGKILL of the engine process closes the group's connections: the follower's next collective fails and
    it exits (within seconds, not the group's timeout)."""
    import signal

    from blink.nic.agent import Agent
    from blink.host.process import engine_process, wait_until_serving

    config = replace(CONFIG, model=model_dir, tensor_parallel_size=2, ring_name=f"blink-test-tp-{uuid.uuid4().hex[:8]}")
    with engine_process(config) as (memory, process):
        wait_until_serving(Agent.attach(memory), process)
        (follower,) = children(process.pid)
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while running(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(follower)
