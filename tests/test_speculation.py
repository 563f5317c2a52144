"""Speculative decoding end to end on the CPU engine (the simulated scheduler proposes and confirms n-gram drafts,
the model step verifies them).

With SmolLM2: every answer equals the same request's answer without speculation, token for token and logprob for
logprob, greedy and seeded, through max_tokens, stop ids, stop strings, the n choices of one OpenAI request,
penalties, grammars, preemption in a small KV pool and a batch of prompts that repeat their text; the engine's
counters show drafts were verified and accepted (so the equality is not one of two plain runs).

With a tiny random model, unseeded: the distribution of sampled answers with speculation equals the one without
(Pearson's chi-square over two samples), where a third of the drafts are accepted.
"""
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from blink.nic.grammars import StructuredOutputs
from blink.nic.openai.requests import Job

PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree, and the fox runs "
           "back into the forest before the sun goes down.")
PROMPTS = [f"Repeat this text exactly, twice: {PASSAGE}\n{PASSAGE}\n", f"Copy: {PASSAGE} Copy again: {PASSAGE[:60]}",
           "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n\ndef add4(a, b, c, d):\n",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The capital of France is"]
# A small pool (preemption) and token budget: drafts must fit the rows and pages left. 16 sequences' decodes leave at
# most 48 of the 64 rows for drafts; 104 pages preempt ~130 times a run and keep some prompts' pages for the prefix
# cache. (8 sequences took 15 % longer on the CPU in one run each, with a third as many drafts: ~75 preemptions.)
PLAIN = EngineConfig(device="cpu", n_slots=32, max_prompt_tokens=96, max_output_tokens=40, max_stop_ids=2,
                     scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, page_size=4, num_pages=104,
                                               max_model_len=136), sim_threads=2)
SPECULATIVE = replace(PLAIN, scheduler=replace(PLAIN.scheduler, speculative=SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)))


# In this order: the last requests (copies, greedy) decode alone at the end; earlier ones draft beside prefills.
CASES = {
    "limits": [SamplingParams(max_tokens=k + 1, temperature=0, stop_token_ids=(13, 29)) for k in range(8)],
    "penalised": [SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                                 frequency_penalty=0.2)] * 8,
    "seeded": [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=k, logprobs=True) for k in range(8)],
    "grammar": [SamplingParams(max_tokens=40, temperature=0)] * 4,     # each with one of GRAMMARS, compiled per engine
    "greedy": [SamplingParams(max_tokens=40, temperature=0, logprobs=True)] * 8,
    # Stop strings end a request on the host side, wherever inside a step's several tokens they match.
    "stop strings": [SamplingParams(max_tokens=40, temperature=0, stop=stop) for stop in
                     (("fox",), ("lazy dog. The",), ("return",), ("8,", "11"), ("Paris",))],
    # Each request's own cap on its drafts (0: none).
    "capped": [SamplingParams(max_tokens=30, temperature=0, num_speculative_tokens=k % 3) for k in range(5)],
    # One OpenAI request's n choices: the server's fan-out of one request into ring requests.
    "choices": Job(chat=False, prompt=[], params=SamplingParams(max_tokens=30, temperature=0.7, seed=11, stop=("oak",)),
                   stop=(), stream=False, include_usage=False, priority=0, n=3).choice_params(),
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
    """The counters of both runs. ``tokens`` counts every token the scheduler made, also those a request made past
    its stop string (matched on the host) until the host's cancel reached the scheduler: how many depends on the
    host's timing and on how many tokens each step made (they differed by 2 of ~1290 once drafts shared steps with
    prefills), so both runs made at least every token of the answers. Their step counts are not compared: the late
    tokens take steps too (up to ~24 per stop-string request on a busy box), as many as accepted drafts save here."""
    (answers, plain), (_, speculative) = runs
    answered = sum(len(out.token_ids) for case in answers.values() for out in case)
    assert plain["spec_draft_tokens"] == plain["spec_accepted_tokens"] == 0
    assert 0 < speculative["spec_accepted_tokens"] <= speculative["spec_draft_tokens"]
    assert speculative["spec_drafts"] <= speculative["spec_draft_tokens"] <= 4 * speculative["spec_drafts"]
    assert min(speculative["tokens"], plain["tokens"]) >= answered
    kept = speculative["spec_accepted_per_pos"]     # a step that kept draft j + 1 kept draft j; 4 drafts at most
    assert sum(kept) == speculative["spec_accepted_tokens"] and list(kept) == sorted(kept, reverse=True)
    assert kept[0] <= speculative["spec_drafts"] and not any(kept[4:]) and not any(plain["spec_accepted_per_pos"])
    assert (plain["num_speculative_tokens"], speculative["num_speculative_tokens"]) == (0, 4)
    assert plain["preempted"] > 0 and speculative["preempted"] > 0, "the pool was meant to be too small"


# -- the sampled distribution ----------------------------------------------------------------------------------------

ABC = (11, 12, 13)      # the prompt repeats them; a logit_bias makes them the likely tokens of a random model
WAVE = 32               # requests prefilled in one step, so the steps after decode only: the steps that draft
ANSWERS = 20 * WAVE     # per run: 27 answers of 3 tokens, ~24 draws each


def sampled_answers(tmp_path, speculative: SpeculativeConfig | None) -> tuple[Counter, dict]:
    from blink.bench.shapes import write_model_dir

    model = write_model_dir(tmp_path / "tiny", "tiny-qwen3")
    # A draft takes a step row of its own: a wave of WAVE decodes leaves WAVE rows for drafts.
    config = EngineConfig(model=str(model), load_format="dummy", device="cpu", n_slots=WAVE, max_prompt_tokens=16,
                          max_output_tokens=3, max_logit_bias=3, sim_threads=2, cpu_kv_cache_gib=0.05,
                          scheduler=SchedulerConfig(max_num_seqs=2 * WAVE, max_num_batched_tokens=512, max_model_len=32,
                                                    speculative=speculative))
    prompt = list(ABC) * 4 + list(ABC[:2])          # ... A B C A B: the lookup drafts C A B
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, logit_bias={t: 50.0 for t in ABC})
    with Engine(config) as engine:
        outs = [out for _ in range(ANSWERS // WAVE)                     # unseeded: a random seed each
                for out in engine.generate([prompt] * WAVE, [params] * WAVE)]
        stats = engine.stats()
    return Counter(tuple(out.token_ids) for out in outs), stats


def two_sample_p_value(a: Counter, b: Counter) -> float:
    """Pearson's chi-square test that two samples come from one distribution (a 2 x K contingency table)."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a[k] for k in keys], [b[k] for k in keys]], np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = ((table - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(keys) - 1), dtype=torch.float64)
    return 1 - torch.distributions.Chi2(dof).cdf(torch.tensor(chi2)).item()


def test_speculation_keeps_the_sampled_distribution(tmp_path):
    """Drafts are accepted only where the target's own sample equals them, so the answers' distribution is the
    plain one; a verifier that kept drafts it should not (biased towards C A B) fails here at p < 1e-3."""
    plain, _ = sampled_answers(tmp_path, None)
    speculated, stats = sampled_answers(tmp_path, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                                                    prompt_lookup_max=2))
    assert sum(plain.values()) == sum(speculated.values()) == ANSWERS
    assert set(plain) <= {(a, b, c) for a in ABC for b in ABC for c in ABC}, "the bias makes A, B, C the answers"
    assert stats["spec_accepted_tokens"] >= ANSWERS // 10, stats    # drafts were accepted (a third), and rejected
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert two_sample_p_value(plain, speculated) > 1e-3, (plain, speculated)
