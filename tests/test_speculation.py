"""Speculative decoding end to end on the CPU engine (the simulated scheduler proposes and confirms n-gram drafts,
the SmolLM2 step verifies them): every answer equals the same request's answer without speculation, token for token
and logprob for logprob, greedy and seeded, through max_tokens, stop ids, penalties, grammars, preemption in a small
KV pool and a batch of prompts that repeat their text; the engine's counters show drafts were verified and
accepted (so the equality is not one of two plain runs)."""
from dataclasses import replace

import pytest

from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from blink.nic.grammars import StructuredOutputs

PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree, and the fox runs "
           "back into the forest before the sun goes down.")
PROMPTS = [f"Repeat this text exactly, twice: {PASSAGE}\n{PASSAGE}\n", f"Copy: {PASSAGE} Copy again: {PASSAGE[:60]}",
           "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n\ndef add4(a, b, c, d):\n",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The capital of France is"]
# A small pool (preemption) and token budget: drafts must fit the rows and pages left.
PLAIN = EngineConfig(device="cpu", n_slots=32, max_prompt_tokens=96, max_output_tokens=40, max_stop_ids=2,
                     scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=80,
                                               max_model_len=136), sim_threads=2)
SPECULATIVE = replace(PLAIN, scheduler=replace(PLAIN.scheduler, speculative=SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)))


# In this order: the last requests (copies, greedy) decode alone at the end, in steps without a prefill.
CASES = {
    "limits": [SamplingParams(max_tokens=k + 1, temperature=0, stop_token_ids=(13, 29)) for k in range(8)],
    "penalised": [SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                                 frequency_penalty=0.2)] * 8,
    "seeded": [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=k, logprobs=True) for k in range(8)],
    "grammar": [SamplingParams(max_tokens=40, temperature=0)] * 4,     # each with one of GRAMMARS, compiled per engine
    "greedy": [SamplingParams(max_tokens=40, temperature=0, logprobs=True)] * 8,
}
# Structured answers that copy their prompt: drafts the grammar lets through, each draft row masked by its own state.
NAMES = "Alice Baker, Bob Carter, Carol Dunn, Alice Baker, Bob Carter"
GRAMMAR_PROMPT = f"Write these names as a JSON object {{\"names\": [...]}}: {NAMES}.\nJSON: "
GRAMMARS = [StructuredOutputs.json({"type": "object", "properties": {"names": {"type": "array", "items": {
    "type": "string", "maxLength": 16}}}, "required": ["names"]}), StructuredOutputs.choice(NAMES.split(", ")[:3])]


def run(config):
    """Every case's requests in one batch (``generate``: as many in the ring at once as it holds)."""
    with Engine(replace(config, max_grammar_bytes=16 << 20)) as engine:
        compiled = [engine.grammar(spec) for spec in GRAMMARS]
        prompts, params = [], []
        for name, case in CASES.items():
            for k, p in enumerate(case):
                grammar = name == "grammar"
                prompts.append(GRAMMAR_PROMPT if grammar else PROMPTS[k % len(PROMPTS)])
                params.append(replace(p, grammar=compiled[k % len(compiled)]) if grammar else p)
        outs = engine.generate(prompts, params)
        stats = engine.stats()
    cut = iter(outs)
    return {name: [next(cut) for _ in case] for name, case in CASES.items()}, stats


@pytest.fixture(scope="module")
def runs():
    return run(PLAIN), run(SPECULATIVE)


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_changes_how_many_tokens_a_step_makes_never_which(runs, case):
    (want, _), (outs, _) = runs
    assert [o.token_ids for o in outs[case]] == [o.token_ids for o in want[case]]
    assert [o.finish_reason for o in outs[case]] == [o.finish_reason for o in want[case]]
    for out, plain_out in zip(outs[case], want[case]):  # batched otherwise: float32 sums in another order
        assert out.logprobs == pytest.approx(plain_out.logprobs, abs=1e-4)
    if case == "grammar":                       # and they follow their grammars
        assert [out.text for out in outs[case][1::2]] == [out.text for out in want[case][1::2]]
        assert all(out.text in NAMES.split(", ") for out in outs[case][1::2])


def test_drafts_were_verified_and_accepted(runs):
    (_, plain), (_, speculative) = runs
    assert plain["spec_draft_tokens"] == plain["spec_accepted_tokens"] == 0
    assert 0 < speculative["spec_accepted_tokens"] <= speculative["spec_draft_tokens"]
    assert speculative["spec_drafts"] <= speculative["spec_draft_tokens"] <= 4 * speculative["spec_drafts"]
    assert speculative["tokens"] == plain["tokens"] and speculative["steps"] < plain["steps"]
