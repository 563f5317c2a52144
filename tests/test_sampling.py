"""``min_p``, ``logit_bias`` and ``top_logprobs`` end to end on the CPU (simulated scheduler + torch step) with the
embedded SmolLM2, against float64 references over transformers' logits of the same steps."""
import pytest
import torch

from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig
from blink.errors import RequestError
from tests.test_engine import PROMPTS, hf, hf_greedy, model_dir, wait_idle  # noqa: F401 (fixtures)

TOP = 5
# A small token budget and pool: chunked prefill, preemption, and step rows that change owner between steps.
CONFIG = EngineConfig(device="cpu", n_slots=12, max_prompt_tokens=48, max_output_tokens=24, max_stop_ids=2,
                      max_logit_bias=4, max_top_logprobs=TOP,
                      scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, page_size=4, num_pages=30,
                                                max_model_len=72), sim_threads=2)


@pytest.fixture(scope="module")
def engine(model_dir):  # noqa: F811
    with Engine(CONFIG) as engine:
        yield engine


def reference_steps(model, prompt: list[int], n: int, bias: dict, eos) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding over transformers' logits + ``bias`` in float64, and each step's log-softmax."""
    out, logprobs = [], []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            if out:
                step = model(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)
            logits = step.logits[0, -1].double()
            for token, b in bias.items():
                logits[token] += b
            logprobs.append(torch.log_softmax(logits, dim=0))
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
    return out, logprobs


def test_logit_bias_gives_the_reference_tokens_beside_other_requests(engine, hf):  # noqa: F811
    """Each request's bias applies to its own row only (plain greedy requests run beside, rows change owner under
    chunked prefill and preemption): the tokens are float64 greedy over transformers' logits + the bias."""
    prompts = [engine.encode(p) for p in PROMPTS]
    plain = hf_greedy(hf, prompts[0], 12)
    biases = [{plain[0]: -100.0, plain[1]: -3.5}, {}, {engine.encode(" banana")[0]: 30.0}, {},
              {engine.encode(" the")[0]: -100.0, engine.encode(",")[0]: 2.25, 13: 0.5, 42: -0.5}]
    params = [SamplingParams(max_tokens=12, temperature=0, logit_bias=b or None) for b in biases]
    before = engine.stats()
    outputs = engine.generate(prompts, params)
    assert wait_idle(engine)["preempted"] > before["preempted"], "the pool was meant to be too small"
    eos = engine.tokenizer.eos_token_ids
    for prompt, bias, out in zip(prompts, biases, outputs, strict=True):
        want, _ = reference_steps(hf, prompt, 12, bias, eos)
        assert out.token_ids == want, bias
    assert outputs[0].token_ids != plain and outputs[2].token_ids != hf_greedy(hf, prompts[2], 12)


def test_min_p_of_one_samples_the_most_likely_token(engine, hf):  # noqa: F811
    """min_p = 1 keeps only the most likely token: a seeded sample at temperature 1.5 is transformers' greedy."""
    prompts = [engine.encode(p) for p in PROMPTS[:3]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, seed=3))
    free = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=1.5, seed=3))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
    assert [o.token_ids for o in free] != [o.token_ids for o in outputs], "without min_p the samples were to differ"


def test_top_logprobs_equal_transformers_top_k_of_the_same_step(engine, hf):  # noqa: F811
    """Each position's top logprobs (with and without a bias, streamed or not) are transformers' log-softmax top-k
    of that step's logits, most likely first; the sampled token's logprob is the same number."""
    prompts = [engine.encode(p) for p in PROMPTS[:2]]
    bias = {engine.encode(" Paris")[0]: -2.0}
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=TOP),
              SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, logit_bias=bias)]
    stream = engine.stream(prompts[0], params[0])
    deltas = list(stream)
    outputs = [stream.output, engine.generate([prompts[1]], params[1])[0]]
    assert [pair for d in deltas for pair in d.top_logprobs] == outputs[0].top_logprobs
    eos = engine.tokenizer.eos_token_ids
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        tokens, steps = reference_steps(hf, prompt, 8, p.logit_bias or {}, eos)
        assert out.token_ids == tokens
        assert len(out.top_logprobs) == len(tokens)
        for step, top, logprob, token in zip(steps, out.top_logprobs, out.logprobs, tokens, strict=True):
            want = step.topk(p.top_logprobs)
            assert [t for t, _ in top] == want.indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top], dtype=torch.float64), want.values,
                                       rtol=0, atol=2e-4)
            assert top[0] == (token, logprob)


def test_requests_beyond_the_ring_are_refused_by_field(engine):
    with pytest.raises(RequestError, match="top_logprobs=6 is above the 5") as refused:
        engine.generate([1, 2], SamplingParams(logprobs=True, top_logprobs=6))
    assert refused.value.field == "top_logprobs"
    with pytest.raises(RequestError, match="logit_bias has 5 tokens; at most 4") as refused:
        engine.generate([1, 2], SamplingParams(logit_bias={t: 1.0 for t in range(5)}))
    assert refused.value.field == "logit_bias"
    # Nothing leaked: a request after the refusals runs to its length (ignore_eos: a sampled end would end it sooner).
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
