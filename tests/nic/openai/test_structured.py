"""Structured outputs end to end: the official openai client -> HTTP -> the agent's grammar compiler (outlines-core)
-> the ring's grammars region -> the real CPU engine (``blink engine`` in another process: the simulated scheduler
walks each request's grammar state, the SmolLM2 step masks its logits) and back. The reference is the grammar
itself: every answer must parse as JSON and validate against its schema (``jsonschema``), match its regex, or be one
of its choices. One engine serves the whole module; requests go concurrently, at temperature 0."""
import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import jsonschema
import openai
import pytest

from blink import EngineConfig, SchedulerConfig
from blink.nic.agent import Agent
from blink.nic.agent_loop import LoopConfig
from blink.nic.openai.server import ServerConfig
from blink.nic.text import Tokenizer
from blink.host.process import engine_process
from blink.ring.reference import standin_engine
from tests.nic.openai.test_server import serving

MODEL = "smollm2-test"
# Room for every schema of the main test in one batch: its answers take as many steps as the longest one.
ENGINE = EngineConfig(device="cpu", n_slots=48, max_prompt_tokens=224, max_output_tokens=96, max_stop_ids=2,
                      max_top_logprobs=5, max_grammar_bytes=48 << 20,
                      scheduler=SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=512, max_model_len=320),
                      cpu_kv_cache_gib=0.5, sim_threads=2)
TIMEOUT_S = 10.0        # the grammar compiler's: one test waits for it (a loaded 2-core box took 4 s for a schema)
CONFIG = ServerConfig(model_name=MODEL, loop=LoopConfig(max_queued=256), grammar_timeout_s=TIMEOUT_S)
ASK = [{"role": "user", "content": "Give me a JSON object that follows the schema."}]


@contextmanager
def http(engine, tokenizer):
    """The HTTP server on a background event loop, over the ring of ``engine``; yields a client factory."""
    with serving(engine, tokenizer, CONFIG, lambda memory: Agent.attach(memory, liveness_timeout_s=10.0)) as served:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0,
                            timeout=300)


@pytest.fixture(scope="module")
def model_dir():
    from blink.models import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def client(model_dir):
    config = replace(ENGINE, model=str(model_dir), ring_name=f"blink-test-structured-{os.getpid()}")
    with http(engine_process(config), Tokenizer(model_dir)) as client:
        yield client


def concurrently(calls):
    """Run the zero-argument ``calls`` at once (the engine batches them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# -- schemas ---------------------------------------------------------------------------------------------------------

# outlines-core's digit bounds (keywords of its own, which validators ignore) keep a small model's numbers finite:
# unbounded, SmolLM2 at temperature 0 may write "1000000..." until max_tokens. (JSON Schema's minimum / maximum are
# not enforced by the grammar: docs/serving.md.)
INTEGER = {"type": "integer", "maxDigits": 4}
NUMBER = {"type": "number", "maxDigitsInteger": 3, "minDigitsFraction": 1, "maxDigitsFraction": 2,
          "minDigitsExponent": 1, "maxDigitsExponent": 1}

HAND_WRITTEN = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": NUMBER, "y": NUMBER}, "required": ["x", "y"]},
        "label": {"enum": ["origin", "corner", "edge"]}}, "required": ["point", "label"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 2, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["code", "ok"]},
    {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"id": {"anyOf": [INTEGER, {"type": "string", "maxLength": 6}]},
                                      "kind": {"const": "user"}}, "required": ["id", "kind"]},
    {"$defs": {"pair": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": INTEGER},
                        "required": ["k", "v"]}},
     "type": "object", "properties": {"first": {"$ref": "#/$defs/pair"}, "second": {"$ref": "#/$defs/pair"}},
     "required": ["first"]},
    {"enum": ["yes", "no", 3, None]},
]


def generated_schemas(seed: int, count: int) -> list[dict]:
    """``count`` random object schemas from ``seed``: nested objects, arrays with item bounds, enums, numbers,
    integers, booleans, patterns and bounded strings, required and optional fields."""
    rng = random.Random(seed)

    def value(depth: int) -> dict:
        kinds = ["string", "integer", "number", "boolean", "enum", "pattern", "array"] + ["object"] * (depth < 2)
        kind = rng.choice(kinds)
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(1, 8)}
        if kind == "enum":
            return {"enum": rng.sample(["alpha", "beta", "gamma", 1, 2.5, True, None], rng.randint(1, 4))}
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(["^[a-z]{1,5}$", "^[0-9]{2,3}$", "^(on|off)$"])}
        if kind == "array":
            low = rng.randint(0, 2)
            return {"type": "array", "items": rng.choice([INTEGER, {"enum": ["x", "y", "z"]}, {"type": "boolean"}]),
                    "minItems": low, "maxItems": low + rng.randint(0, 2)}
        if kind == "object":
            return obj(depth + 1)
        return {"integer": INTEGER, "number": NUMBER}.get(kind, {"type": kind})

    def obj(depth: int) -> dict:
        names = rng.sample(["a", "b", "c", "d", "e"], rng.randint(1, 3 - depth))
        properties = {name: value(depth) for name in names}
        return {"type": "object", "properties": properties, "required": [n for n in names if rng.random() < 0.7]}

    return [obj(0) for _ in range(count)]


def test_every_answer_parses_and_follows_its_schema(client):
    schemas = HAND_WRITTEN + generated_schemas(seed=7, count=40)      # tests/nic/test_grammars.py compiles 100
    replies = concurrently([lambda s=s: client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=96, temperature=0, response_format=json_schema(s)) for s in schemas])
    for schema, reply in zip(schemas, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_vllms_structured_outputs_on_both_endpoints(client):
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    choices = ["sunny", "cloudy", "raining cats and dogs"]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    calls = []
    for outputs in ({"regex": regex}, {"choice": choices}, {"json": schema}, {"json": json.dumps(schema)}):
        calls.append(lambda o=outputs: client.completions.create(
            model=MODEL, prompt="The weather today:", max_tokens=40, temperature=0,
            extra_body={"structured_outputs": o}).choices[0])
        calls.append(lambda o=outputs: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the weather?"}], max_tokens=40,
            temperature=0, extra_body={"structured_outputs": o}).choices[0])
    results = concurrently(calls)
    texts = [c.text if hasattr(c, "text") else c.message.content for c in results]
    assert all(c.finish_reason == "stop" for c in results), texts
    assert all(re.fullmatch(regex, t) for t in texts[0:2]), texts
    assert all(t in choices for t in texts[2:4]), texts
    for text in texts[4:]:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_answers_are_json_objects(client):
    prompts = ["Reply with a JSON object saying ok is true.", "Give a JSON object with one key, name."]
    replies = concurrently([lambda p=p: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=48, temperature=0,
        response_format={"type": "json_object"}) for p in prompts])
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_streamed_equals_whole_and_each_choice_follows_the_schema(client):
    schema = HAND_WRITTEN[1]
    whole, chunks = concurrently([
        lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                               response_format=json_schema(schema), n=2),
        lambda: list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                                    response_format=json_schema(schema), stream=True))])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == whole.choices[1].message.content
    jsonschema.validate(json.loads(text), schema)


def test_top_logprobs_leave_out_the_tokens_the_grammar_forbids(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=5, extra_body={"structured_outputs": {"choice": ["yes"]}})
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == "yes"
    rest = "yes"
    for entry in content[:-1]:      # only what can still become "yes" is a candidate: never a -inf
        assert entry.top_logprobs and all(rest.startswith(top.token) for top in entry.top_logprobs)
        assert all(top.logprob > -1e30 for top in entry.top_logprobs)
        rest = rest[len(entry.token):]
    # Then the end of sequence, the only token the finished grammar allows: probability 1.
    assert rest == "" and [(t.token, t.logprob) for t in content[-1].top_logprobs] == [("<|im_end|>", 0.0)]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "'schema' is a JSON schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex",
     "not a regular expression"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "non-empty strings"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json", "not valid JSON"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= x"}}}, "structured_outputs.grammar",
     "not supported"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs", "both"),
]


@pytest.mark.parametrize("fields, param, message", BAD)
def test_a_bad_structured_output_is_a_400_naming_its_field(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    body = error.value.response.json()["error"]
    assert (body["type"], body["param"]) == ("invalid_request_error", param)
    assert message in body["message"]


def test_a_schema_too_large_to_compile_in_time_is_a_400_and_the_next_compiles(client):
    huge = json_schema({"type": "string", "maxLength": 4000})
    for _ in range(2):      # the second is refused from memory, at once
        with pytest.raises(openai.BadRequestError, match=f"did not compile within {TIMEOUT_S:g} s"):
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, response_format=huge)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["fine"]}})
    assert reply.choices[0].message.content == "fine"


def test_a_ring_without_grammars_refuses_them(model_dir):
    """An engine started with --max-grammar-bytes 0 serves no grammars and gets a ring without the region: structured
    outputs are refused at once, saying so."""
    tokenizer = Tokenizer(model_dir)
    geometry = replace(ENGINE, max_grammar_bytes=0).geometry(ENGINE.scheduler.max_model_len)
    with http(standin_engine(geometry, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids),
              tokenizer) as bare:
        with pytest.raises(openai.BadRequestError, match="no grammar table") as error:
            bare.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                         response_format={"type": "json_object"})
        assert error.value.response.json()["error"]["param"] == "response_format"
        assert bare.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content
