"""blink.engine end to end on the CPU (simulated scheduler + torch step) with the embedded SmolLM2, against HF
transformers' greedy ``generate``; start-up failures leave nothing behind. GPU tests (H200) at the end."""
import os
import threading
import time
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch

from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig
from blink.core import EngineCore
from blink.errors import CheckpointError, ConfigError, EngineClosed, RequestError

# A small token budget forces chunked prefill (the longest prompt has 42 tokens), a small KV pool forces preemption.
CONFIG = EngineConfig(device="cpu", n_slots=12, max_prompt_tokens=48, max_output_tokens=24, max_stop_ids=2,
                      scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, page_size=4, num_pages=30,
                                                max_model_len=72), sim_threads=2)
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the "
           "fall of Constantinople in 1453, and it shaped law, language and architecture across Europe.",
           "1, 2, 3, 4,", "Once upon a time, in a small village, there lived"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=20, temperature=0)


@pytest.fixture(scope="module")
def model_dir():
    from blink.models import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(CONFIG) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# model -> {prompt: (tokens asked, transformers' greedy continuation)}: several tests ask for the same prompts
_GREEDY = weakref.WeakKeyDictionary()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation; it stops after an EOS token, which it includes. Its first n tokens do not
    depend on how many were asked for, so a continuation computed before for at least n (or one that ended at an EOS
    sooner) answers again."""
    known = _GREEDY.setdefault(hf, {})
    asked, tokens = known.get(tuple(prompt), (0, []))
    if n <= asked or len(tokens) < asked:
        return tokens[:n]
    with torch.no_grad():
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    known[tuple(prompt)] = n, out[0, len(prompt):].tolist()
    return known[tuple(prompt)][1][:n]


def staggered(engine, prompts, params) -> list:
    """Submit one prompt after another, each once the earlier requests have produced more tokens; all run together."""
    streams = []
    for prompt in prompts:
        for earlier in streams:
            next(earlier, None)
        streams.append(engine.stream(prompt, params))
    return [s.result() for s in streams]


def wait_idle(engine, timeout_s=30.0) -> dict:
    """Until the scheduler runs nothing and every KV page is free again; returns the stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]:
            return stats
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.01)


# -- outputs -----------------------------------------------------------------------------------------------------

def test_greedy_outputs_equal_transformers_under_chunked_prefill_and_preemption(engine, hf):
    prompts = [engine.encode(p) for p in PROMPTS] + [engine.tokenizer.encode_chat(CHAT)]
    before = engine.stats()
    outputs = staggered(engine, prompts, GREEDY)
    after = wait_idle(engine)
    assert after["preempted"] > before["preempted"], "the pool was meant to be too small for every sequence"
    eos = engine.tokenizer.eos_token_ids
    for prompt, out in zip(prompts, outputs, strict=True):
        want = hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if want[-1] in eos else "length")
        assert out.text == engine.tokenizer.decode(want)
        assert out.prompt_token_ids == prompt


def penalized_greedy(hf, prompt: list[int], n: int, params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    """Greedy decoding with vLLM's penalties, in float64 over transformers' logits: the reference. Each token's
    logits come from transformers' KV cache, as in its own ``generate``, not from the whole sequence again."""
    out = []
    with torch.no_grad():
        step = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            if out:
                step = hf(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)
            logits = step.logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
            seen = counts > 0
            seen[prompt] = True
            rep = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
    return out


def test_penalties_give_the_reference_tokens_under_chunked_prefill_and_preemption(engine, hf):
    """Each request's penalties apply to its own history only (a plain greedy request runs beside them), through
    chunked prefill and the recompute of preempted sequences."""
    prompts = [engine.encode(p) for p in PROMPTS[1:]]
    penalized = [SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3),
                 SamplingParams(max_tokens=16, temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
                 SamplingParams(max_tokens=16, temperature=0, frequency_penalty=-0.5, repetition_penalty=0.8)]
    plain = SamplingParams(max_tokens=16, temperature=0)
    before = engine.stats()
    outputs = engine.generate(prompts, [*penalized, plain])
    assert wait_idle(engine)["preempted"] > before["preempted"], "the pool was meant to be too small"
    eos = engine.tokenizer.eos_token_ids
    for prompt, params, out in zip(prompts, penalized, outputs, strict=False):
        assert out.token_ids == penalized_greedy(hf, prompt, params.max_tokens, params, eos), params
    assert outputs[3].token_ids == hf_greedy(hf, prompts[3], plain.max_tokens)
    # transformers' own repetition penalty (its logits processor), for the first
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.3)[0, len(prompts[0]):].tolist()
    assert outputs[0].token_ids == hf_out
    assert outputs[0].token_ids != hf_greedy(hf, prompts[0], 16), "the penalty was meant to change the output"


@pytest.fixture(scope="module")
def uncached():
    """The module's engine with prefix caching off."""
    with Engine(replace(CONFIG, scheduler=replace(CONFIG.scheduler, enable_prefix_caching=False))) as engine:
        yield engine


SYSTEM = "You are a concise assistant. Answer every question in one short sentence."
# Short answers (8-16 tokens, each follow-up answered at once): a long one would only add decode steps of one
# sequence at the end of each round.
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
             "What is two plus two?"]


def shared_prefix_run(engine) -> tuple[list[list[int]], list[list[int]], dict]:
    """One chat prompt cancelled after its first token; chat prompts sharing its system prompt, twice, staggered
    (chunked prefill, preemption); then each answer's conversation again with a follow-up. Returns the prompts,
    their outputs and the engine's counters over the run."""
    chats = [engine.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
             for q in QUESTIONS]
    before = wait_idle(engine)
    victim = engine.stream(chats[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    next(victim)
    victim.cancel()
    assert victim.result().finish_reason == "abort"
    outputs = staggered(engine, chats * 2, GREEDY)
    follow_ups = [chat + out.token_ids[:10] + engine.encode(" Why?") for chat, out in zip(chats, outputs)]
    outputs += staggered(engine, follow_ups, GREEDY)
    after = wait_idle(engine)
    counts = {k: after[k] - before[k] for k in ("prefix_hit_tokens", "prefill_tokens", "preempted")}
    return chats * 2 + follow_ups, [out.token_ids for out in outputs], counts


def test_shared_prefixes_give_the_same_greedy_tokens_with_and_without_the_prefix_cache(engine, uncached, hf):
    prompts, cached_tokens, cached = shared_prefix_run(engine)
    _, plain_tokens, plain = shared_prefix_run(uncached)
    assert cached_tokens == plain_tokens
    want = {tuple(p): hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts}     # the second round repeats the first
    assert cached_tokens == [want[tuple(p)] for p in prompts]
    # After the cancelled one, every request finds at least the 5 pages (22 tokens) its template and system prompt
    # share; a repeated prompt all its pages but the last, a follow-up its answer's pages too.
    assert cached["prefix_hit_tokens"] >= 12 * 5 * CONFIG.scheduler.page_size and plain["prefix_hit_tokens"] == 0
    assert cached["prefill_tokens"] < plain["prefill_tokens"]
    assert plain["preempted"] > 0, "the pool was meant to be too small for every sequence"


def test_generate_takes_strings_and_token_lists_and_streams_the_same_text(engine):
    params = SamplingParams(max_tokens=6, temperature=0)
    by_text, by_ids = engine.generate([PROMPTS[0], engine.encode(PROMPTS[0])], params)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 6
    deltas = list(engine.stream(PROMPTS[0], params))
    assert [t for d in deltas for t in d.token_ids] == by_text.token_ids
    assert "".join(d.text for d in deltas) == by_text.text
    assert [d.finish_reason for d in deltas][-1] == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, logprobs=True)
    alone = engine.generate(PROMPTS[4], params)[0]
    crowd = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in range(3)]
    batched = engine.generate([PROMPTS[1], PROMPTS[4], PROMPTS[0], PROMPTS[3]], [crowd[0], params, *crowd[1:]])[1]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)     # batched GEMMs round differently
    assert len(alone.logprobs) == 12 and all(lp <= 0 for lp in alone.logprobs)
    other_seed = engine.generate(PROMPTS[4], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other_seed.token_ids != alone.token_ids


def test_max_tokens_eos_and_stop_ids_end_requests(engine, hf):
    chat = engine.tokenizer.encode_chat(CHAT)
    want = hf_greedy(hf, chat, 24)
    eos = engine.tokenizer.eos_token_ids
    assert want[-1] in eos and len(want) < 24, "the chat answer is meant to end with EOS"
    by_eos, ignoring, short = engine.generate([chat] * 3, [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=0)])
    assert (by_eos.token_ids, by_eos.finish_reason) == (want, "stop")
    assert ignoring.token_ids[:len(want)] == want and len(ignoring.token_ids) == 24
    assert ignoring.finish_reason == "length"
    assert (short.token_ids, short.finish_reason) == (want[:3], "length")
    stop = want[4]
    stopped = engine.generate(chat, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop,)))[0]
    assert (stopped.token_ids, stopped.finish_reason) == (want[:want.index(stop) + 1], "stop")


def test_cancellation_returns_every_kv_page(engine):
    wait_idle(engine)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    running = engine.stream(PROMPTS[2], params)
    next(running)
    # More requests than max_num_seqs: some are still waiting in the ring when they are cancelled.
    others = [engine.stream(p, params) for p in PROMPTS * 2]
    running.cancel()
    for stream in others[::2]:
        stream.cancel()
    for stream in others[1::2]:
        stream.close()          # cancels without reading on
    assert running.result().finish_reason == "abort" and len(running.output.token_ids) < 24
    assert {s.result().finish_reason for s in others[::2]} == {"abort"}
    stats = wait_idle(engine)
    assert stats["kv_pages_free"] == stats["kv_pages_total"] == CONFIG.scheduler.num_pages


def test_streams_from_several_threads(engine):
    params = SamplingParams(max_tokens=5, temperature=0)
    want = {p: engine.generate(p, params)[0].token_ids for p in PROMPTS[:3]}
    got = {}

    def consume(prompt):
        got[prompt] = engine.stream(prompt, params).result().token_ids

    threads = [threading.Thread(target=consume, args=(p,)) for p in PROMPTS[:3]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_bad_prompts_are_refused_before_the_ring(engine):
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 49152\)"):
        engine.generate([[1, 2, 49152]])
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.generate([[1] * 49])
    with pytest.raises(ValueError, match="max_output_tokens"):
        engine.generate("hi", SamplingParams(max_tokens=25))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate(["hi"], [GREEDY, GREEDY])
    with pytest.raises(RequestError, match="params must be a SamplingParams"):
        engine.generate([[1, 2]], {"max_tokens": 3})


def test_one_bad_request_in_a_generate_call_submits_none_of_them(engine):
    """The good prompts before a bad one are not left running in the ring, unanswered, with their queues kept."""
    params = SamplingParams(max_tokens=4, temperature=0)
    submitted = engine.stats()["submitted"]
    for bad in ([[1, 2, 3], [4, 5, 6], [1, -1]], [[1, 2, 3], [1] * 49]):
        with pytest.raises(ValueError):
            engine.generate(bad, params)
    with pytest.raises(ValueError, match="max_output_tokens"):
        engine.generate([[1, 2, 3], [4, 5, 6]], [params, SamplingParams(max_tokens=25)])
    assert engine.stats()["submitted"] == submitted and engine.agent.in_flight == 0 and not engine._queues
    assert [out.token_ids for out in engine.generate([[1, 2, 3], [4, 5, 6]], params)] == [
        engine.generate([1, 2, 3], params)[0].token_ids, engine.generate([4, 5, 6], params)[0].token_ids]


def test_numpy_token_ids_are_prompts_like_lists(engine):
    params = SamplingParams(max_tokens=4, temperature=0)
    want = engine.generate([1, 2, 3], params)[0].token_ids
    assert engine.generate(np.array([1, 2, 3]), params)[0].token_ids == want
    assert [o.token_ids for o in engine.generate(np.array([[1, 2, 3], [1, 2, 3]]), params)] == [want, want]


# -- start-up and shutdown -------------------------------------------------------------------------------------

def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("blink-")]


def write_model_dir(path, model_dir, config_edit=None, weights: bytes | None = None):
    """A copy of the default model directory (weights linked), with its config or weights replaced."""
    import json

    path.mkdir()
    for f in model_dir.iterdir():
        (path / f.name).symlink_to(f)
    if config_edit is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config_edit(config)
        (path / "config.json").unlink()
        (path / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (path / "model.safetensors").unlink()
        (path / "model.safetensors").write_bytes(weights)
    return path


@pytest.mark.parametrize("case", ["missing", "corrupt", "architecture", "kv budget", "kv beyond memory",
                                  "kv beyond int32", "context", "ring"])
def test_bad_start_up_raises_one_clear_error_and_leaves_nothing(case, tmp_path, model_dir):
    ring = f"blink-test-{os.getpid()}-{case.replace(' ', '-')}"
    threads = engine_threads()
    config = replace(CONFIG, ring_name=ring)
    cases = {   # case -> (EngineConfig fields, given tmp_path; error; message)
        "missing": (lambda: {"model": str(tmp_path / "nothing")}, ConfigError, "nothing: no such file"),
        "corrupt": (lambda: {"model": str(write_model_dir(tmp_path / "m", model_dir, weights=b"\x00garbage"))},
                    CheckpointError, "not a readable safetensors file"),
        "architecture": (lambda: {"model": str(write_model_dir(
            tmp_path / "m", model_dir, lambda c: c.update(architectures=["GPT2LMHeadModel"])))},
            ConfigError, "'GPT2LMHeadModel' is not supported"),
        # 17.5 pages of SmolLM2's float32 KV (30 layers x K, V x 4 tokens x 3 heads x 64 x 4 B): 17 fit
        "kv budget": (lambda: {"scheduler": replace(CONFIG.scheduler, num_pages=None),
                               "cpu_kv_cache_gib": 17.5 * 30 * 2 * 4 * 3 * 64 * 4 / 2**30}, ValueError,
                      r"holds 17 pages of 4 tokens, but one sequence of max_model_len=72 tokens needs 18"),
        "kv beyond memory": (lambda: {"scheduler": replace(CONFIG.scheduler, num_pages=None),
                                      "cpu_kv_cache_gib": 1e5}, ValueError,     # 100 TiB, < 2**31 pages
                             r"more than this host's .* GiB of memory: lower EngineConfig.cpu_kv_cache_gib=100000.0"),
        "kv beyond int32": (lambda: {"scheduler": replace(CONFIG.scheduler, num_pages=None),
                                     "cpu_kv_cache_gib": 1e30}, ValueError,
                            r"beyond the 2\*\*31 - 1 .* \(EngineConfig.cpu_kv_cache_gib=1e\+30\)"),
        "context": (lambda: {"scheduler": replace(CONFIG.scheduler, max_model_len=9000, num_pages=None)}, ValueError,
                    r"max_model_len=9000 is longer than the model's context"),
        "ring": (lambda: {"max_prompt_tokens": 8192, "max_output_tokens": 64}, ValueError,
                 "max_prompt_tokens=8192 leaves no room to generate"),
    }
    overrides, error, message = cases[case]
    with pytest.raises(error, match=message):
        EngineCore(replace(config, **overrides()))
    assert not os.path.exists(f"/dev/shm/{ring}")
    assert engine_threads() == threads


def test_engine_config_names_the_bad_field():
    with pytest.raises(ValueError, match=r"EngineConfig.device must be one of \('auto', 'cpu', 'cuda'\)"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="EngineConfig.gpu_memory_utilization must be a float in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="EngineConfig.ring_name"):
        EngineConfig(ring_name="a/b")


def test_close_aborts_in_flight_requests_and_stops_the_loop(model_dir):
    threads = engine_threads()
    engine = Engine(replace(CONFIG, scheduler=replace(CONFIG.scheduler, num_pages=None), cpu_kv_cache_gib=0.01))
    assert engine.stats()["kv_pages_total"] == int(0.01 * 2**30) // (30 * 2 * 4 * 3 * 64 * 4)
    stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
    next(stream)
    engine.close()
    engine.close()
    assert engine_threads() == threads
    with pytest.raises(EngineClosed, match="the engine is closed"):
        engine.generate("hi")


def test_a_shared_memory_ring_is_driven_by_an_agent_of_its_own(engine):
    from blink.nic.agent import Agent
    from blink.ring.transport import SharedMemory

    ring = f"blink-test-{os.getpid()}-shared"
    prompt = engine.encode(PROMPTS[1])
    want = engine.generate([prompt], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="driven by an agent process of its own"):
        Engine(replace(CONFIG, ring_name=ring))
    with EngineCore(replace(CONFIG, ring_name=ring)) as shared:
        with SharedMemory.open(ring) as memory:
            agent = Agent(memory, shared.geometry)
            request = agent.submit(prompt, GREEDY)
            tokens, finished = [], False
            while not finished:
                for out in agent.poll():
                    assert out.request_id == request
                    tokens += out.new_tokens
                    finished = out.finished
                time.sleep(0.01)
    assert tokens == want
    assert not os.path.exists(f"/dev/shm/{ring}")


def test_dummy_weights_need_only_a_config(tmp_path):
    """load_format="dummy": random weights for a config.json alone; no tokenizer, so prompts are token ids."""
    import json

    from blink.models import ModelConfig

    config = ModelConfig("Qwen3ForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=16,
                         max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    with Engine(replace(CONFIG, model=str(tmp_path), load_format="dummy")) as engine:
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))[0]
        assert len(out.token_ids) == 4 and all(0 <= t < 300 for t in out.token_ids) and out.text is None
        with pytest.raises(ValueError, match="no tokenizer.json: pass prompts as lists of token ids"):
            engine.generate("text")


# -- on the H200 -------------------------------------------------------------------------------------------------

def smollm2_shaped_checkpoint(path):
    """SmolLM2-135M's architecture with random weights (transformers' init), saved as an HF checkpoint. The real
    checkpoint (a 94 MB GGUF) cannot travel to the GPU machine; CI checks it on the CPU above."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
                         eos_token_id=None)     # the engine has no tokenizer here, so no EOS to stop at
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


@pytest.mark.gpu
def test_gpu_greedy_outputs_equal_transformers(tmp_path, monkeypatch):
    # float32 end to end: Triton would otherwise round float32 attention inputs to TF32 in tl.dot.
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    hf_model = smollm2_shaped_checkpoint(tmp_path)
    config = replace(CONFIG, model=str(tmp_path), device="cuda", scheduler=replace(CONFIG.scheduler, num_pages=None),
                     gpu_memory_utilization=0.3)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (3, 9, 17, 30, 42, 48)] * 4
    with Engine(config) as engine:
        assert engine.device == "cuda"
        outputs = staggered(engine, prompts, GREEDY)
        stats = wait_idle(engine)
    hf_model = hf_model.cuda()
    want = {tuple(p): hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts}
    assert [out.token_ids for out in outputs] == [want[tuple(p)] for p in prompts]
    assert stats["launch_error"] == 0 and stats["finished"] == len(outputs)


def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
    return prompt_len


@pytest.mark.gpu
def test_gpu_engine_admits_by_a_policy_given_in_its_config(tmp_path):
    """EngineConfig(policy=...) reaches the GPU scheduler's image (the example does the same on the CPU): with one
    running sequence, requests waiting behind it finish in the policy's order, not in arrival order."""
    import asyncio

    from blink import AsyncEngine

    smollm2_shaped_checkpoint(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cuda", policy=shortest_prompt_first, n_slots=8,
                          gpu_memory_utilization=0.3,
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64))

    async def run():
        async with await AsyncEngine.start(config) as engine:
            first = engine.stream([1], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            await anext(first)
            finished = []

            async def one(n):
                # Several steps each, so that no two finish between two polls of the agent (which reports those in
                # slot order): then they finish in admission order.
                await engine.generate(list(range(1, n + 1)), SamplingParams(max_tokens=8, temperature=0,
                                                                            ignore_eos=True))
                finished.append(n)

            await asyncio.gather(first.result(), *(one(n) for n in (9, 2, 30, 5, 17)))
            return finished

    assert asyncio.run(run()) == [2, 5, 9, 17, 30]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_answers_walk_their_grammars_beside_unconstrained_ones(device, tmp_path):
    """The step masks each row to the tokens of its grammar state and the scheduler moves the state by each token:
    on random weights over a byte-level vocabulary, every token of a constrained answer is one its state allowed
    (the Python walk of the ring's format), a finite grammar's answer ends where its automaton accepts, and the
    unconstrained requests batched with them are left alone (equal to their runs alone)."""
    pytest.importorskip("outlines_core")
    from blink.bench.shapes import write_model_dir
    from blink.nic.grammars import StructuredOutputs
    from blink.ring.grammar import allowed, next_state, start_state

    config = EngineConfig(model=str(write_model_dir(tmp_path / "m", "tiny-qwen3", "bytes")), load_format="dummy",
                          device=device, n_slots=16, max_prompt_tokens=32, max_output_tokens=40,
                          max_grammar_bytes=8 << 20, gpu_memory_utilization=0.3, cpu_kv_cache_gib=0.05, sim_threads=2,
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=80))
    choices = ["yes", "no", "t300 t301"]
    specs = [StructuredOutputs.json({"type": "object", "properties": {"n": {"type": "integer"},
                                                                        "s": {"type": "string"}}}),
             StructuredOutputs("regex", r"[0-9]{3}-[a-c]{2}"), StructuredOutputs.choice(choices),
             StructuredOutputs.json({"enum": [1, "two", [3]]}), StructuredOutputs("json_object", "")]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 500, int(rng.integers(3, 30))).tolist() for _ in range(14)]
    with Engine(config) as llm:
        grammars = [llm.grammar(spec) for spec in specs] * 2
        params = [SamplingParams(max_tokens=40, temperature=0.0 if k < 5 else 1.0, seed=k, grammar=grammar)
                  for k, grammar in enumerate(grammars)] + [SamplingParams(max_tokens=40, temperature=0)] * 4
        outs = llm.generate(prompts, params)
        alone = llm.generate(prompts[len(grammars):], params[len(grammars):])
    for out, grammar in zip(outs, grammars):
        region = np.frombuffer(grammar.placed(0, 1), "<i4")
        state = start_state(region, 0)
        for token in out.token_ids:
            assert token in allowed(region, state, grammar.vocab_size)
            state = next_state(region, state, token, grammar.vocab_size)
        if out.finish_reason == "stop":
            assert llm.tokenizer.eos_token_ids[0] in allowed(region, state, grammar.vocab_size)
    for k in (1, 2, 3, 6, 7, 8):          # finite grammars: they end within max_tokens
        assert outs[k].finish_reason == "stop"
    assert {outs[2].text, outs[7].text} <= set(choices) and outs[3].text in ('1', '"two"', "[3]")
    assert [out.token_ids for out in outs[len(grammars):]] == [out.token_ids for out in alone]


# -- stop strings and the asyncio API ----------------------------------------------------------------------------

def test_stop_strings_cut_the_text_and_end_the_request(engine):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = engine.generate(PROMPTS[4], params)[0]
    stop = full.text[len(full.text) // 2:][:3]
    cut = engine.generate(PROMPTS[4], replace(params, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    assert engine.tokenizer.decode(cut.token_ids).find(stop) >= 0, "the last token kept completes the stop string"
    assert stop not in engine.tokenizer.decode(cut.token_ids[:-1])
    wait_idle(engine)       # the request was cancelled in the ring: its pages are back


@pytest.fixture(scope="module")
def async_engine():
    import asyncio

    from blink import AsyncEngine

    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(AsyncEngine.start(CONFIG))
    yield loop, engine
    loop.run_until_complete(engine.close())
    loop.close()


def test_async_engine_generates_and_streams_what_the_engine_does(engine, async_engine):
    loop, aengine = async_engine
    want = engine.generate(PROMPTS[:3], GREEDY)

    async def run():
        import asyncio

        outputs = await asyncio.gather(*(aengine.generate(p, GREEDY) for p in PROMPTS[:3]))
        deltas = [d async for d in aengine.stream(PROMPTS[0], GREEDY)]
        return outputs, deltas

    outputs, deltas = loop.run_until_complete(run())
    assert [o.token_ids for o in outputs] == [w.token_ids for w in want]
    assert [o.text for o in outputs] == [w.text for w in want]
    assert [t for d in deltas for t in d.token_ids] == want[0].token_ids
    assert "".join(d.text for d in deltas) == want[0].text and deltas[-1].finish_reason == want[0].finish_reason


def test_async_streams_are_cancelled_with_their_task_or_by_cancel(async_engine):
    import asyncio

    loop, aengine = async_engine
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def consume(stream, started):
        async for _ in stream:
            started.set()

    async def run():
        started = asyncio.Event()
        task = asyncio.create_task(consume(aengine.stream(PROMPTS[2], params), started))
        await started.wait()
        task.cancel()                          # the consumer goes away mid-stream: its request is aborted
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = aengine.stream(PROMPTS[1], params)
        first = await anext(stream)
        await stream.cancel()
        rest = [d async for d in stream]
        waiting = [aengine.stream(p, params) for p in PROMPTS * 2]     # more than max_num_seqs: some never start
        for s in waiting:
            await s.cancel()
        reasons = [(await s.result()).finish_reason for s in waiting]
        return first, rest, reasons

    first, rest, reasons = loop.run_until_complete(run())
    assert rest[-1].finish_reason == "abort" and len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 24
    assert set(reasons) == {"abort"}
    stats = wait_idle(aengine)
    assert stats["kv_pages_free"] == CONFIG.scheduler.num_pages


def test_async_engine_stop_strings_and_closed_engine(async_engine):
    loop, aengine = async_engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = loop.run_until_complete(aengine.generate(PROMPTS[4], params))
    stop = full.text[len(full.text) // 2:][:3]
    cut = loop.run_until_complete(aengine.generate(PROMPTS[4], replace(params, stop=(stop,))))
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]


def test_a_started_engine_takes_a_request_at_once(model_dir):
    """``AsyncEngine.start`` returns once the scheduler loop serves: a request right after it is never refused as
    "still starting" (``examples/custom_policy.py`` once was, one run in six)."""
    import asyncio

    from blink import AsyncEngine
    from blink.ring.control import ENGINE_SERVING

    async def start_and_ask():
        async with await AsyncEngine.start(CONFIG) as engine:
            serving = engine.stats()["engine_state"] == ENGINE_SERVING
            return serving, await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))

    serving, out = asyncio.run(start_and_ask())
    assert serving and len(out.token_ids) == 2
