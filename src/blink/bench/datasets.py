"""Benchmark requests: ShareGPT_V3 conversations read from a local JSON file, a synthetic ShareGPT-like set, or a
synthetic set of shared prefixes (``shared_prefix``: one system prompt before every request, optionally multi-turn
conversations that resend their history) for the prefix cache.

Every request carries its prompt as token ids, so the server's prompt length is exactly ``prompt_len`` (no
re-tokenization on the server), and ``output_len`` is the ``max_tokens`` it asks for.

Filter (vLLM's ``is_valid_sequence`` for ShareGPT): ``prompt_len >= 4``, ``output_len >= 4``, ``prompt_len <= 1024``,
``prompt_len + output_len <= 2048``. Both ShareGPT-like datasets obey it; a length the user fixes (``output_len``,
and for the synthetic set ``input_len``, as ``vllm bench serve --random-input-len/--random-output-len`` fix them) is
taken as given: only the drawn length is checked, against its own bounds. The shared-prefix set bounds each turn
instead (``MAX_TURN_LEN``).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048

# Log-normal token lengths, chosen so that after the filter the means match vLLM's ShareGPT_V3 sample (1000 prompts,
# seed 0, Llama tokenizer: 215,196 prompt tokens, i.e. 215 per request; ~200 completion tokens per request). Medians:
# 156 prompt, 137 output tokens; both have the long right tail of chat traffic.
PROMPT_LOG_MEAN, PROMPT_LOG_STD = 5.05, 1.0
OUTPUT_LOG_MEAN, OUTPUT_LOG_STD = 4.92, 0.9


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: ``prompt`` token ids (``len(prompt) == prompt_len``) and the tokens to generate."""

    prompt: list[int]
    prompt_len: int
    output_len: int


def is_valid(prompt_len: int, output_len: int, fixed_output: bool, fixed_input: bool = False) -> bool:
    """vLLM's ShareGPT filter (module docstring) of the lengths that were drawn; a fixed length passes as given
    (with the total bound, a fixed output of 2048 or more would pass no prompt at all)."""
    prompt_ok = fixed_input or MIN_LEN <= prompt_len <= MAX_PROMPT_LEN
    output_ok = fixed_output or output_len >= MIN_LEN
    return prompt_ok and output_ok and (fixed_input or fixed_output or prompt_len + output_len <= MAX_TOTAL_LEN)


def synthetic(num_prompts: int, vocab_size: int, seed: int = 0, output_len: int | None = None,
              input_len: int | None = None) -> list[SampleRequest]:
    """``num_prompts`` requests with log-normal, ShareGPT-like lengths and uniformly random prompt tokens.

    Invariant: request ``i`` depends only on ``(seed, i)`` (and the fixed lengths), so a smaller ``num_prompts`` gives
    a prefix of a larger one. ``output_len`` and ``input_len`` fix every request's output and prompt length instead
    of drawing them.
    """
    if vocab_size < 1 or any(n is not None and n < 1 for n in (output_len, input_len)):
        raise ValueError(f"vocab_size, output_len and input_len must be >= 1 (got {vocab_size}, {output_len}, "
                         f"{input_len})")
    return [_synthetic_one(np.random.default_rng([seed, i]), vocab_size, output_len, input_len)
            for i in range(num_prompts)]


def _synthetic_one(rng: np.random.Generator, vocab_size: int, output_len: int | None,
                   input_len: int | None) -> SampleRequest:
    while True:     # rejection sampling: the same filter that ShareGPT conversations go through
        prompt_len = input_len if input_len is not None else round(rng.lognormal(PROMPT_LOG_MEAN, PROMPT_LOG_STD))
        out = output_len if output_len is not None else round(rng.lognormal(OUTPUT_LOG_MEAN, OUTPUT_LOG_STD))
        if is_valid(prompt_len, out, output_len is not None, input_len is not None):
            prompt = rng.integers(0, vocab_size, prompt_len).tolist()
            return SampleRequest(prompt, prompt_len, out)


def sharegpt(path: str, encode, num_prompts: int, seed: int = 0, output_len: int | None = None) -> list[SampleRequest]:
    """``num_prompts`` requests from a ShareGPT_V3 JSON file (``[{"conversations": [{"from", "value"}, ...]}, ...]``).

    As vLLM samples it: conversations with at least two turns, shuffled with ``random.Random(seed)``; the first turn
    is the prompt and the second turn's token count the output length (unless ``output_len`` fixes it); conversations
    that fail the filter are skipped. ``encode(text) -> list[int]`` is the model's tokenizer. ``ValueError`` if the
    file holds fewer usable conversations than asked for.
    """
    with open(path) as f:
        data = json.load(f)
    conversations = [entry["conversations"] for entry in (data if isinstance(data, list) else [])
                     if isinstance(entry, dict) and len(entry.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(conversations)
    requests = []
    for turns in conversations:
        if len(requests) == num_prompts:
            break
        prompt = encode(turns[0]["value"])
        out = output_len if output_len is not None else len(encode(turns[1]["value"]))
        if is_valid(len(prompt), out, output_len is not None):
            requests.append(SampleRequest(prompt, len(prompt), out))
    if len(requests) < num_prompts:
        raise ValueError(f"{path} has only {len(requests)} usable conversations (list entries whose "
                         f"'conversations' have two turns or more, with {MIN_LEN}..{MAX_PROMPT_LEN} prompt tokens and "
                         f"at most {MAX_TOTAL_LEN} in all); --num-prompts asks for {num_prompts}")
    return requests


# Shared prefixes: a system prompt of DEFAULT_PREFIX_LEN tokens (1-2K, as chat and agent deployments have), turns of
# ShareGPT-like length cut to MAX_TURN_LEN.
DEFAULT_PREFIX_LEN = 1536
MAX_TURN_LEN = 256


def shared_prefix(num_prompts: int, vocab_size: int, seed: int = 0, output_len: int | None = None,
                  prefix_len: int = DEFAULT_PREFIX_LEN, turns: int = 1) -> list[SampleRequest]:
    """``num_prompts`` requests that all begin with one system prompt of ``prefix_len`` random tokens.

    ``turns == 1``: each request is the system prompt and a user turn of its own. ``turns > 1``: conversations of
    ``turns`` requests each, every conversation's first turn before any second turn, and so on; turn ``t``'s prompt is
    the system prompt, the ``t - 1`` earlier exchanges (user turn, then assistant turn) and its user turn. The
    assistant turns are random tokens of the exchange's output length, not what a server answered (an open-loop
    benchmark cannot wait for the answers), so a turn reuses the prompt of the turn before it, not its generated
    pages. Turn and output lengths are ShareGPT-like, in ``[MIN_LEN, MAX_TURN_LEN]`` (``output_len`` fixes the
    outputs). Deterministic in its arguments.
    """
    if vocab_size < 1 or prefix_len < 0 or turns < 1:
        raise ValueError(f"vocab_size and turns must be >= 1 and prefix_len >= 0 (got {vocab_size}, {turns}, "
                         f"{prefix_len})")
    rng = np.random.default_rng([seed, prefix_len, turns])
    system = rng.integers(0, vocab_size, prefix_len).tolist()
    conversations = -(-num_prompts // turns)
    histories = [list(system) for _ in range(conversations)]
    requests = []
    for _ in range(turns):
        for history in histories:
            user = rng.integers(0, vocab_size, _turn_len(rng, PROMPT_LOG_MEAN, PROMPT_LOG_STD)).tolist()
            out = output_len if output_len is not None else _turn_len(rng, OUTPUT_LOG_MEAN, OUTPUT_LOG_STD)
            history += user
            requests.append(SampleRequest(list(history), len(history), out))
            history += rng.integers(0, vocab_size, out).tolist()      # the assistant turn the next one resends
    return requests[:num_prompts]


def _turn_len(rng: np.random.Generator, log_mean: float, log_std: float) -> int:
    while True:
        n = round(rng.lognormal(log_mean, log_std))
        if MIN_LEN <= n <= MAX_TURN_LEN:
            return n
