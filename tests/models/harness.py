"""Test harness for the model tests: tiny HF reference models, and a driver that runs blink steps over mixed
batches (chunked prefill + decodes, shuffled pages) and compares every sampled row with HF transformers."""
from __future__ import annotations

import random

import torch

from blink.device.step import StepBuffers, StepLayout
from blink.models.batch import SeqChunk, fill_step

PAGE_SIZE = 4


def tiny_hf_model(arch: str, **overrides):
    """A float32 HF model with small random weights (norm weights too) for ``arch``."""
    import transformers

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**base)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


class Runner:
    """Runs blink steps for several sequences, giving each its own shuffled pages of one pool."""

    def __init__(self, model, num_pages=64, layout=StepLayout(64, 8, 16), seed=0, kv_dtype=None):
        self.model, self.layout = model, layout
        self.buf = StepBuffers(layout, model.device)
        self.kv = model.allocate_kv_cache(num_pages, PAGE_SIZE, kv_dtype)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}

    def chunk(self, seq: int, tokens: list[int], start: int, sample=True, **params) -> SeqChunk:
        pages = self.pages.setdefault(seq, [])
        while len(pages) * PAGE_SIZE < start + len(tokens):
            pages.append(self.free.pop())
        return SeqChunk(tokens, start, pages, sample, **params)

    def step(self, chunks: list[SeqChunk], bucket: int | None = None):
        """Returns (logits of the sampled rows, sampled ids, sampled logprobs) for rows ``0..len(chunks)-1``."""
        n = fill_step(self.buf, chunks, PAGE_SIZE)
        logits = self.model(self.buf, self.kv, bucket or n).float()
        k = len(chunks)
        return logits[:k], self.buf.sampled_ids[:k].clone(), self.buf.sampled_logprobs[:k].clone()


def mixed_batches(model, seed=0) -> list[tuple[list[int], torch.Tensor, int, torch.Tensor]]:
    """Three steps mixing full prefills, a prefill split in two chunks, and decodes, in a padded bucket. Returns
    (the sequence's tokens so far, logits, sampled id, logprob) for every sampled row of every step, in order."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 9, 12)]
    runner = Runner(model, seed=seed)
    plan = [  # (sequence, chunk length or None for one decode token) per step
        [(0, 5), (1, 8), (2, 9)],
        [(0, None), (1, 9), (2, None), (3, 12)],
        [(3, None), (0, None), (1, None), (2, None)],
    ]
    seqs = {i: [] for i in range(4)}
    rows = []
    for step in plan:
        chunks = []
        for i, n in step:
            start = len(seqs[i])
            new = prompts[i][start:start + n] if n else [rng.randrange(vocab)]
            seqs[i] += new
            chunks.append(runner.chunk(i, new, start, sample=len(seqs[i]) >= len(prompts[i])))
        logits, ids, logprobs = runner.step(chunks, bucket=sum(len(c.tokens) for c in chunks) + 3)
        rows += [(list(seqs[i]), logits[row].cpu(), int(ids[row]), logprobs[row].cpu())
                 for row, ((i, _), c) in enumerate(zip(step, chunks)) if c.sample]
    return rows


def check_mixed_batches(model, hf_model, atol=1e-4, seed=0):
    """``mixed_batches``: every sampled row's logits must match HF's logits at the same position of the same token
    sequence, its sampled id be their argmax (greedy) and its logprob that id's log-softmax."""
    for tokens, logits, token, logprob in mixed_batches(model, seed):
        torch.testing.assert_close(logits, hf_logits(hf_model, tokens)[-1], atol=atol, rtol=atol)
        assert token == logits.argmax()
        torch.testing.assert_close(logprob, torch.log_softmax(logits, 0)[token])


def greedy_continuations(model, prompts: list[list[int]], n: int, kv_dtype=None) -> list[list[int]]:
    """``n`` greedy tokens per prompt, all prompts batched: one prefill step, then decode steps (the KV pool in
    ``kv_dtype``, the model's by default)."""
    runner = Runner(model, num_pages=256, layout=StepLayout(256, 8, 64), kv_dtype=kv_dtype)
    seqs = [list(p) for p in prompts]
    chunks = [runner.chunk(i, p, 0) for i, p in enumerate(prompts)]
    for _ in range(n):
        _, ids, _ = runner.step(chunks)
        for s, t in zip(seqs, ids.tolist()):
            s.append(t)
        chunks = [runner.chunk(i, s[-1:], len(s) - 1) for i, s in enumerate(seqs)]
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` (KV-cached); it may stop early at an EOS token, which it includes."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def device_launch(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream):
    """Re-instantiate a captured graph for device launch (as the scheduler will), upload it, launch it once."""
    from cuda.bindings import runtime as rt

    def ok(result):
        assert int(result[0]) == 0, result[0]
        return result[1] if len(result) > 1 else None

    flag = rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    exec_ = ok(rt.cudaGraphInstantiateWithFlags(rt.cudaGraph_t(init_value=graph.raw_cuda_graph()), flag))
    rs = rt.cudaStream_t(init_value=stream.cuda_stream)
    ok(rt.cudaGraphUpload(exec_, rs))
    return lambda: ok(rt.cudaGraphLaunch(exec_, rs))


def check_step_graph_device_launch(model, bucket: int = 48):
    """Capture ``model``'s step (a CUDA model) for ``bucket`` tokens, re-instantiate it for device launch and check
    that launches over two different batches (prefill, decodes at long contexts, a non-sampling chunk, sampling
    parameters; at ``bucket`` 1 one decode at a long context) reproduce eager steps bit for bit: logits, sampled ids
    and logprobs."""
    runner = Runner(model, num_pages=256, layout=StepLayout(64, 16, 128))
    vocab = model.config.vocab_size

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
        decode = runner.chunk(1, rand(1), 300, temperature=0.7, top_p=0.9, seed=5)
        if bucket == 1:
            return [decode]
        return [runner.chunk(0, rand(20), 0), decode, runner.chunk(2 + seed, rand(9), 0, sample=False),
                runner.chunk(9, rand(1), 37, temperature=1.0, top_k=20, seed=seed)]

    def eager(chunks):
        fill_step(runner.buf, chunks, PAGE_SIZE)
        runner.buf.sampled_ids.fill_(-1)
        logits = model(runner.buf, runner.kv, bucket).clone()
        return logits, runner.buf.sampled_ids.clone(), runner.buf.sampled_logprobs.clone()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        first = eager(batch(0))  # also compiles the kernels
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            static_logits = model(runner.buf, runner.kv, bucket)
    launch = device_launch(graph, stream)
    for seed, want in ((0, first), (1, None)):
        with torch.cuda.stream(stream):
            want = want or eager(batch(seed))
            fill_step(runner.buf, batch(seed), PAGE_SIZE)
            runner.buf.sampled_ids.fill_(-1)
            launch()
        stream.synchronize()
        assert torch.equal(static_logits, want[0])
        assert torch.equal(runner.buf.sampled_ids, want[1]) and torch.equal(runner.buf.sampled_logprobs, want[2])


def check_cpu_engine_greedy(hf_model, path, **config) -> None:
    """The CPU engine serving the checkpoint at ``path`` (with ``config``'s EngineConfig fields) answers two prompts
    greedily with ``hf_model``'s tokens, up to where transformers stops."""
    from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig

    prompts = [[5, 6, 7, 8], [9, 10]]
    engine = Engine(EngineConfig(model=str(path), device="cpu", max_prompt_tokens=32, max_output_tokens=16, n_slots=8,
                                 scheduler=SchedulerConfig(num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
                                                           max_model_len=48), **config))
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    finally:
        engine.close()
    for prompt, out in zip(prompts, outputs):
        want = hf_greedy(hf_model, prompt, 6)
        assert out.token_ids[:len(want)] == want


def decode(model, prompts: list[list[int]], n: int, forced: torch.Tensor | None = None, kv_dtype=None):
    """``n`` steps after one batched prefill of ``prompts``: (``[prompts, n]`` log-probabilities of the fed tokens,
    the model's greedy tokens). Each step feeds the ``forced`` token (``[prompts, n]``) or, without, the greedy one:
    then the greedy tokens are the model's greedy text, and with ``forced`` they equal it wherever that text would
    be ``forced``."""
    runner = Runner(model, num_pages=256, layout=StepLayout(256, 16, 64), kv_dtype=kv_dtype)
    chunks = [runner.chunk(i, p, 0) for i, p in enumerate(prompts)]
    logprobs, greedy = torch.empty(len(prompts), n), torch.empty(len(prompts), n, dtype=torch.long)
    for j in range(n):
        logits, greedy[:, j], _ = runner.step(chunks)
        fed = greedy[:, j] if forced is None else forced[:, j]
        logprobs[:, j] = torch.log_softmax(logits.float(), -1).gather(1, fed[:, None])[:, 0]
        chunks = [runner.chunk(i, [int(fed[i])], len(p) + j) for i, p in enumerate(prompts)]
    return logprobs, greedy
