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

    def __init__(self, model, num_pages=64, layout=StepLayout(64, 8, 16), seed=0):
        self.model, self.layout = model, layout
        self.buf = StepBuffers(layout, model.device)
        self.kv = model.allocate_kv_cache(num_pages, PAGE_SIZE)
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
        logits = self.model(self.buf, self.kv, bucket or n)
        k = len(chunks)
        return logits[:k], self.buf.sampled_ids[:k].clone(), self.buf.sampled_logprobs[:k].clone()


def check_mixed_batches(model, hf_model, atol=1e-4, seed=0):
    """Three steps mixing full prefills, a prefill split in two chunks, and decodes, in a padded bucket; every
    sampled row's logits must match HF's logits at the same position of the same token sequence."""
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
    for step in plan:
        chunks = []
        for i, n in step:
            start = len(seqs[i])
            new = prompts[i][start:start + n] if n else [rng.randrange(vocab)]
            seqs[i] += new
            chunks.append(runner.chunk(i, new, start, sample=len(seqs[i]) >= len(prompts[i])))
        logits, ids, logprobs = runner.step(chunks, bucket=sum(len(c.tokens) for c in chunks) + 3)
        for row, ((i, _), c) in enumerate(zip(step, chunks)):
            if not c.sample:
                continue
            want = hf_logits(hf_model, seqs[i])[-1]
            torch.testing.assert_close(logits[row].cpu(), want, atol=atol, rtol=atol)
            assert ids[row] == logits[row].argmax()
            torch.testing.assert_close(logprobs[row], torch.log_softmax(logits[row], 0)[ids[row]])


def greedy_continuations(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens per prompt, all prompts batched: one prefill step, then decode steps."""
    runner = Runner(model, num_pages=256, layout=StepLayout(256, 8, 64))
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
