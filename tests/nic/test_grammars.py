"""The grammar compiler (blink.nic.grammars) against the served tokenizer: every text an automaton lets through,
walked token by token from its start to an end-of-sequence token, is what it was compiled from asked for (it
parses and validates against its JSON schema, matches its regex, is one of its choices); refusals say why."""
import json
import sys
import re

import jsonschema
import numpy as np
import pytest

from blink.models import default_model_path
from blink.nic.grammars import GrammarCompiler, GrammarError, StructuredOutputs
from blink.nic.text import Tokenizer
from blink.ring.grammar import allowed, next_state, start_state
from tests.nic.openai.test_structured import HAND_WRITTEN, generated_schemas


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, 16 << 20, 30.0)
    yield compiler
    compiler.close()


def walk(grammar, tokenizer, rng, limit=400) -> str:
    """A random text the grammar allows: random allowed tokens until an end-of-sequence token is drawn."""
    region = np.frombuffer(grammar.placed(0, 1), "<i4")
    vocab, eos = grammar.vocab_size, set(tokenizer.eos_token_ids)
    state, tokens = start_state(region, 0), []
    for _ in range(limit):
        choices = allowed(region, state, vocab)
        ends = [t for t in choices if t in eos]
        if ends and (len(ends) == len(choices) or rng.random() < 0.3):
            return tokenizer.decode(tokens)
        token = int(rng.choice([t for t in choices if t not in eos]))
        tokens.append(token)
        state = next_state(region, state, token, vocab)
    raise AssertionError(f"no end after {limit} tokens: {tokenizer.decode(tokens)!r}")


def test_a_hundred_schemas_let_through_only_valid_json(compiler, tokenizer):
    rng = np.random.default_rng(3)
    for schema in HAND_WRITTEN + generated_schemas(seed=11, count=92):
        grammar = compiler.compile(StructuredOutputs.json(schema))
        for _ in range(2):
            jsonschema.validate(json.loads(walk(grammar, tokenizer, rng)), schema)


def test_regexes_and_choices_let_through_what_they_say(compiler, tokenizer):
    rng = np.random.default_rng(4)
    for regex in (r"[a-c]{2,4}", r"(yes|no)!", r"[0-9]{3}-[0-9]{2}", r"\{\"k\": [1-9]\}"):
        grammar = compiler.compile(StructuredOutputs("regex", regex))
        for _ in range(5):
            assert re.fullmatch(regex, walk(grammar, tokenizer, rng))
    choices = ["a.b", "(x|y)", "multi word choice", "Ünïcode ✓"]
    grammar = compiler.compile(StructuredOutputs.choice(choices))
    texts = {walk(grammar, tokenizer, rng) for _ in range(30)}
    assert texts <= set(choices) and len(texts) >= 2
    assert walk(compiler.compile(StructuredOutputs.choice(choices[3:])), tokenizer, rng) == choices[3]
    assert isinstance(json.loads(walk(compiler.compile(StructuredOutputs("json_object", "")), tokenizer, rng)), dict)


def test_equal_requests_share_one_compiled_grammar(compiler):
    a = compiler.compile(StructuredOutputs.json({"type": "boolean"}))
    assert compiler.compile(StructuredOutputs.json('{"type":  "boolean"}')) is a


def test_a_grammar_larger_than_the_table_is_refused_before_it_is_built(tokenizer):
    small = GrammarCompiler(tokenizer, tokenizer.vocab_size, 64 << 10, 30.0)
    try:
        with pytest.raises(GrammarError, match=r"compiles to \d+ automaton states .* more than the 65536 .*"
                                               "--max-grammar-bytes"):
            small.compile(StructuredOutputs.json({"enum": [f"word number {k}" for k in range(30)]}))
        assert small.compile(StructuredOutputs.choice(["ok"])).nbytes <= 64 << 10
    finally:
        small.close()


def test_the_python_api_compiles_for_its_engine():
    from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig

    config = EngineConfig(device="cpu", n_slots=4, max_prompt_tokens=64, max_output_tokens=16,
                          max_grammar_bytes=4 << 20,
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=80),
                          cpu_kv_cache_gib=0.05, sim_threads=2)
    with Engine(config) as llm:
        choices = ["red", "green", "a shade of blue"]
        grammar = llm.grammar(StructuredOutputs.choice(choices))
        outs = llm.generate(["Grass is", "The sky is"], SamplingParams(max_tokens=16, temperature=0, grammar=grammar))
        assert all(out.text in choices and out.finish_reason == "stop" for out in outs)


def test_a_model_without_an_end_of_sequence_token_refuses_grammars_and_serves_the_rest(tmp_path):
    """No grammar could end (the shapes' word tokenizer has no EOS): each structured output is refused saying so,
    and the compiler (so the server holding it) starts all the same."""
    from blink.bench.shapes import write_model_dir

    words = Tokenizer(write_model_dir(tmp_path / "tiny", "tiny-qwen3"))
    assert not words.eos_token_ids
    compiler = GrammarCompiler(words, words.vocab_size, 1 << 20, 30.0)
    try:
        with pytest.raises(GrammarError, match="this model has no end-of-sequence token, so no grammar could end"):
            compiler.compile(StructuredOutputs.choice(["t1", "t2"]))
    finally:
        compiler.close()


def test_without_outlines_core_a_structured_output_is_refused_naming_the_install(monkeypatch):
    """The GPU image ran the server from source without outlines-core: a json_schema request got a 500 (a bare
    ModuleNotFoundError). Now the refusal (a 400, as every ``GrammarError``) names what to install; a regex needs no
    outlines-core to become one."""
    monkeypatch.setitem(sys.modules, "outlines_core.json_schema", None)  # import raises ModuleNotFoundError
    for spec in (StructuredOutputs.json({"type": "object"}), StructuredOutputs("json_object", "")):
        with pytest.raises(GrammarError, match="outlines-core, which compiles grammars, is not installed"):
            spec.regex()
    assert StructuredOutputs("regex", "[ab]+").regex() == "[ab]+"
