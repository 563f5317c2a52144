"""Tool calling end to end: the official openai client (and LangChain's ChatOpenAI) -> HTTP -> the chat template with
the tools (the Hermes-style template of examples/) -> the real CPU engine (SmolLM2) -> the answer read for calls.
The references: a forced call's arguments validate against its tool's schema (``jsonschema``); an "auto" answer is
what the Hermes format reads in the same request's raw text (``tool_choice`` "none"); a streamed answer adds up to
the whole one; the prompt is transformers' rendering of the same template. One engine serves the whole module;
requests go concurrently, at temperature 0."""
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

import httpx  # noqa: E402  (the openai client's own HTTP library)
import jsonschema  # noqa: E402

from blink.nic.openai.tool_parsers import Hermes  # noqa: E402
from blink.nic.openai.tools import ToolFields  # noqa: E402
from blink.nic.openai.errors import ApiError  # noqa: E402
from blink.nic.text import Tokenizer, chat_template_argument  # noqa: E402
from blink.host.process import engine_process  # noqa: E402
from blink.ring.reference import standin_engine  # noqa: E402
from tests.nic.openai.test_structured import ENGINE, MODEL, concurrently, http  # noqa: E402
from tests.nic.openai.test_tool_parsers import read  # noqa: E402

TEMPLATE = Path(__file__).parents[3] / "examples" / "tool_chat_template_hermes.jinja"
# The system prompt with two tools takes ~300 tokens.
TOOLS_ENGINE = replace(ENGINE, n_slots=16, max_prompt_tokens=512,
                       scheduler=replace(ENGINE.scheduler, max_num_seqs=16, max_model_len=640))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
# Makes the model write a Hermes call after some text (tool_choice "auto" reads it; "none" leaves it as content).
WRITES_A_CALL = {"regex": r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": '
                          r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def model_dir():
    from blink.models import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir, chat_template=chat_template_argument(str(TEMPLATE)))


@pytest.fixture(scope="module")
def client(model_dir, tokenizer):
    config = replace(TOOLS_ENGINE, model=str(model_dir), ring_name=f"blink-test-tools-{os.getpid()}")
    with http(engine_process(config), tokenizer) as client:
        yield client


def ask(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                          **fields)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def assert_valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_choice_calls_that_function_with_arguments_that_follow_its_schema(client):
    replies = concurrently([lambda n=n: ask(client, tool_choice=named(n)) for n in SCHEMAS])
    for name, reply in zip(SCHEMAS, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c for c, _ in calls_of(choice.message)] == [name]
        assert_valid(calls_of(choice.message))
        assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"


def test_required_calls_follow_the_schema_of_the_tool_they_name(client):
    several, one = concurrently([lambda: ask(client, tool_choice="required", n=2),
                                 lambda: ask(client, tool_choice="required", parallel_tool_calls=False)])
    for choice in [*several.choices, *one.choices]:
        assert choice.finish_reason == "tool_calls", choice.message
        assert calls_of(choice.message) and choice.message.content is None
        assert_valid(calls_of(choice.message))
    assert len(one.choices[0].message.tool_calls) == 1


def streamed(chunks) -> tuple[str, list, str, list]:
    """(content, calls, finish_reason, logprob tokens) of a streamed chat answer, checking each call's deltas."""
    content, calls, finish, tokens = "", [], None, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else None) or []]
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:        # a call's first delta: all but its arguments
                assert (delta.index, delta.type, delta.function.arguments) == (len(calls), "function", "")
                assert delta.id.startswith("call_") and delta.function.name
                calls.append([delta.function.name, ""])
            else:
                assert delta.function.name is None and delta.index == len(calls) - 1
                calls[delta.index][1] += delta.function.arguments
        finish = choice.finish_reason or finish
    assert not any(markup in content for markup in ("<tool_call>", "</tool_call>"))
    return content, [tuple(c) for c in calls], finish, tokens


@pytest.mark.parametrize("fields", [{"tool_choice": named("get_time")}, {"tool_choice": "required"},
                                    {"extra_body": {"structured_outputs": WRITES_A_CALL}}],
                         ids=["named", "required", "auto"])
def test_streamed_calls_add_up_to_the_whole_answer(client, fields):
    whole, chunks = concurrently([lambda: ask(client, logprobs=True, **fields),
                                  lambda: list(ask(client, logprobs=True, stream=True, **fields))])
    choice = whole.choices[0]
    expected = (choice.message.content or "", calls_of(choice.message), choice.finish_reason,
                [t.token for t in choice.logprobs.content])
    assert streamed(chunks) == expected
    assert expected[1] and expected[2] == "tool_calls"


@pytest.mark.parametrize("fields", [{"extra_body": {"structured_outputs": WRITES_A_CALL}}, {}],
                         ids=["a call", "as the model likes"])
def test_auto_answers_the_calls_the_hermes_format_reads_in_the_raw_text(client, fields):
    auto, raw = concurrently([lambda: ask(client, **fields), lambda: ask(client, tool_choice="none", **fields)])
    assert raw.choices[0].message.tool_calls is None
    content, calls = read(Hermes(), [raw.choices[0].message.content])
    assert ((auto.choices[0].message.content or ""), calls_of(auto.choices[0].message)) == (content, calls)
    assert auto.choices[0].finish_reason == ("tool_calls" if calls else raw.choices[0].finish_reason)
    if "extra_body" in fields:
        assert content == "Let me check." and [name for name, _ in calls] == ["get_weather"]


CONVERSATION = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]


def test_a_conversation_with_calls_and_their_results_renders_as_transformers_renders_it(client, model_dir):
    from transformers import AutoTokenizer

    reply = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, max_tokens=8,
                                           temperature=0, tool_choice="none")
    assert reply.choices[0].message.content
    # transformers takes a call's arguments as an object
    hf_messages = json.loads(json.dumps(CONVERSATION))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "celsius"}
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        hf_messages, tools=TOOLS, chat_template=TEMPLATE.read_text(), add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]
    base = str(client.base_url).removesuffix("/v1/")
    tokenized = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": CONVERSATION, "tools": TOOLS})
    assert tokenized.json()["tokens"] == expected
    assert reply.usage.prompt_tokens == len(expected)


BAD = [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "no spaces"}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": named("get_news")}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": named("f")}, "tools[0].function.parameters"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[param for _, param in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(client, fields, param):
    body = {"messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=body.pop("messages"), extra_body=body)
    assert (error.value.response.json()["error"]["param"], error.value.status_code) == (param, 400)


def test_auto_needs_a_known_call_format_and_a_template_that_shows_the_tools(model_dir):
    """A model whose template teaches no call format (the embedded SmolLM2's): "auto" is a 400 saying to pass
    --tool-call-parser, while the forced choices need no format; with the format given, a template that never
    reads the tools is a 400 too."""
    tokenizer = Tokenizer(model_dir)
    geometry = TOOLS_ENGINE.geometry(TOOLS_ENGINE.scheduler.max_model_len)
    with http(standin_engine(geometry, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids),
              tokenizer) as bare:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser hermes or llama3_json") as error:
            bare.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
        assert error.value.response.json()["error"]["param"] == "tool_choice"
        plain = bare.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert plain.choices[0].message.tool_calls is None
    with pytest.raises(ApiError, match="--chat-template") as error:
        ToolFields("hermes", renders_tools=False).request({"tools": TOOLS})
    assert error.value.param == "tools"


def test_required_moves_each_tools_definitions_to_the_root_of_its_schema():
    """With "required" every tool's schema is one item of an array: the $refs of each still resolve, at the root."""
    pair = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "$defs": {"pair": pair}, "type": "object", "properties": {"p": {"$ref": "#/$defs/pair"}}, "required": ["p"]}}}
        for name in ("f", "g")]
    request = ToolFields("hermes", True).request({"tools": tools, "tool_choice": "required",
                                                  "parallel_tool_calls": False})
    param, spec = request.forced()
    schema = json.loads(spec.text)
    assert param == "tools" and schema["$defs"] == {"pair": pair} and schema["maxItems"] == 1
    jsonschema.validate([{"name": "g", "parameters": {"p": {"k": "v"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {"p": {"k": 1}}}], schema)
    tools[1]["function"]["parameters"]["$defs"] = {"pair": {"type": "integer"}}
    with pytest.raises(ApiError) as error:
        ToolFields("hermes", True).request({"tools": tools, "tool_choice": "required"}).forced()
    assert error.value.param == "tools[1].function.parameters"


# -- LangChain ---------------------------------------------------------------------------------------------------------

def test_langchain_structured_output_and_bound_tools(client):
    langchain_openai = pytest.importorskip("langchain_openai")
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""
        name: Annotated[str, Field(max_length=12)]
        mood: Literal["happy", "sad"]

    class GetWeather(BaseModel):
        """The weather in a city."""
        city: Annotated[str, Field(max_length=12)]
        unit: Literal["celsius", "fahrenheit"]

    chat = langchain_openai.ChatOpenAI(base_url=str(client.base_url), api_key="unused", model=MODEL, temperature=0,
                                       max_tokens=64, max_retries=0)
    person, forced, any_tool = concurrently([
        lambda: chat.with_structured_output(Person).invoke("Invent a person."),
        lambda: chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Paris?"),
        lambda: chat.bind_tools([GetWeather], tool_choice="any").invoke("Weather in Paris?")])
    assert isinstance(person, Person)
    assert [call["name"] for call in forced.tool_calls] == ["GetWeather"]
    assert {call["name"] for call in any_tool.tool_calls} == {"GetWeather"}     # "any" is "required": one or more
    for call in forced.tool_calls + any_tool.tool_calls:
        GetWeather.model_validate(call["args"])
    assert not forced.invalid_tool_calls and not any_tool.invalid_tool_calls
