"""The tool-call readers on texts: each format's calls, text around them, several calls, malformed ones left as
content; and streamed in any pieces, the same answer as the whole text. The references are the formats themselves:
texts written out by hand, and texts assembled from known content and calls."""
import json
import random

import pytest

from blink.nic.openai.tool_parsers import (Arguments, CallStart, Hermes, JsonEnd, Llama3Json, NamedCall,
                                           RequiredCalls, detect)


def answer(events: list) -> tuple[str, list[tuple[str, str]]]:
    """The content and ``(name, arguments)`` calls that ``events`` add up to."""
    content, calls = "", []
    for event in events:
        if isinstance(event, CallStart):
            calls.append([event.name, ""])
        elif isinstance(event, Arguments):
            assert calls, "arguments before any call"
            calls[-1][1] += event.text
        else:
            content += event
    return content, [tuple(call) for call in calls]


def read(parser, pieces) -> tuple[str, list]:
    events = []
    for piece in pieces:
        events += parser.push(piece)
    return answer(events + parser.finish())


def cut(text: str, rng: random.Random) -> list[str]:
    """``text`` in random pieces, empty ones and single characters among them."""
    points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    points += [len(text)]
    return [text[a:b] for a, b in zip([0, *points], points)] + [""]


def assert_any_pieces_read_the_same(make, text: str, expected, tries: int = 200) -> None:
    rng = random.Random(text)
    assert read(make(), [text]) == expected
    assert read(make(), list(text)) == expected
    for _ in range(tries):
        assert read(make(), cut(text, rng)) == expected


def call(name: str, arguments: dict) -> tuple[str, str]:
    return name, json.dumps(arguments, ensure_ascii=False)


HERMES = [
    ('Let me look. \n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n',
     ("Let me look.", [call("get_weather", {"city": "Paris", "days": 2}), call("get_time", {})])),
    ('<tool_call>{"name": "f", "arguments": {"s": "a } \\" ] {"}}</tool_call>',
     ("", [call("f", {"s": 'a } " ] {'})])),
    # the closing tag may be left out at the end; text after a call is content
    ('<tool_call>{"name": "f", "arguments": {"x": [1, {"y": null}]}}', ("", [call("f", {"x": [1, {"y": None}]})])),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> Done, sir.', ("Done, sir.", [call("f", {})])),
    # malformed JSON, or JSON that is no call, is content, markup and all; the calls after it still count
    ('hi <tool_call>{"name": "f", "arguments": {"a": 1</tool_call> then <tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>', ('hi <tool_call>{"name": "f", "arguments": {"a": 1</tool_call> then', [call("g", {})])),
    ('x <tool_call>{"name": "f"}</tool_call> y', ('x <tool_call>{"name": "f"}</tool_call> y', [])),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', ('<tool_call>{"name": "f", "arguments": "{}"}'
                                                                 '</tool_call>', [])),
    ('<tool_call>{name: f}</tool_call>', ("<tool_call>{name: f}</tool_call>", [])),
    ('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
     ('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>', [])),
    ("<tool_call> not json", ("<tool_call> not json", [])),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2}', ('<tool_call>{"name": "f", "arguments": {"a": [1, 2}', [])),
    # text that only looks like the start of markup, and whitespace away from calls, are content
    ("a < b and <tool", ("a < b and <tool", [])),
    ("  indented\n\n", ("  indented\n\n", [])),
    ("", ("", [])),
]


@pytest.mark.parametrize("text, expected", HERMES)
def test_hermes(text, expected):
    assert_any_pieces_read_the_same(Hermes, text, expected)


def test_hermes_with_one_call_at_most_drops_the_others():
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
            '</tool_call> ok')
    assert_any_pieces_read_the_same(lambda: Hermes(max_calls=1), text, ("ok", [call("f", {})]))


def test_hermes_texts_assembled_from_content_and_calls():
    """Random content (with markup-like characters) and calls, joined by whitespace: the reader gives back exactly
    those calls, and the content without the whitespace that touches a call."""
    rng = random.Random(3)
    words = ["hello", "<", "<tool", "{", "}", '"', "tool_call>", "é", "日本", "\\"]
    for _ in range(150):
        text, content, calls = "", "", []
        after_call = False
        for _ in range(rng.randint(0, 6)):
            space = rng.choice(["", " ", "\n", " \n "])
            if rng.random() < 0.4:
                name = rng.choice(["get_weather", "f", "a-b_1"])
                arguments = {rng.choice(["x", "y"]): rng.choice([1, "}{", [True, None], {"k": "v"}, "é"])}
                text += space + "<tool_call>" + rng.choice(["", "\n"]) + json.dumps(
                    {"name": name, "arguments": arguments}, ensure_ascii=rng.random() < 0.5) + \
                    rng.choice(["", "\n"]) + "</tool_call>"
                calls.append(call(name, arguments))
                content = content.rstrip()
                after_call = True
            else:
                piece = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
                if "<tool_call>" in text[-12:] + space + piece:
                    continue        # the words happened to spell the opening tag
                text += space + piece
                content += (space + piece).lstrip() if after_call else space + piece
                after_call = False
        assert_any_pieces_read_the_same(Hermes, text, (content, calls), tries=20)


LLAMA3 = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "arguments": {}}',
     ("", [call("get_weather", {"city": "Paris"}), call("get_time", {})])),
    ('\n{"name": "f", "parameters": {"a": {"b": "}"}}}\n', ("", [call("f", {"a": {"b": "}"}})])),
    ('{"name": "f", "parameters": {}} and that is all', ("and that is all", [call("f", {})])),
    # a later object that is no call is content from its ';' on
    ('{"name": "f", "parameters": {"a": 1}} ; {oops} rest', ("; {oops} rest", [call("f", {"a": 1})])),
    ('{"name": "f", "parameters": {}};', ("", [call("f", {})])),
    # JSON that is no call, and text, are content as they were written
    ('  {"answer": 42}', ('  {"answer": 42}', [])),
    ('{"name": "f", "parameters": {"a": 1}', ('{"name": "f", "parameters": {"a": 1}', [])),
    ("Hello there, {friend}", ("Hello there, {friend}", [])),
    ("<|python_tag|> print(1)", ("<|python_tag|> print(1)", [])),
    ("<|python", ("<|python", [])),
    ("", ("", [])),
]


@pytest.mark.parametrize("text, expected", LLAMA3)
def test_llama3_json(text, expected):
    assert_any_pieces_read_the_same(Llama3Json, text, expected)


def test_llama3_json_with_one_call_at_most_drops_the_others():
    text = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'
    assert_any_pieces_read_the_same(lambda: Llama3Json(max_calls=1), text, ("", [call("f", {})]))


REQUIRED = [
    ('[{"name": "f", "parameters": {"a": [1, {"b": "]}\\""}]}}, {"name":"g","parameters":{}}]',
     ("", [("f", '{"a": [1, {"b": "]}\\""}]}'), ("g", "{}")])),
    ('[ { "name" : "f" , "parameters" : 5 } ]', ("", [("f", "5")])),
    ('[{"name": "f", "parameters": "x, }"}]', ("", [("f", '"x, }"')])),
    # cut short (max_tokens): the arguments written so far
    ('[{"name": "f", "parameters": {"a": "unfinish', ("", [("f", '{"a": "unfinish')])),
    ('[{"name": "f", "param', ("", [])),
]


@pytest.mark.parametrize("text, expected", REQUIRED)
def test_required_calls_stream_their_arguments_as_written(text, expected):
    assert_any_pieces_read_the_same(RequiredCalls, text, expected)


def test_a_named_call_is_the_whole_answer():
    text = '{"a": "}<tool_call>"}'
    assert_any_pieces_read_the_same(lambda: NamedCall("f"), text, ("", [("f", text)]))
    assert read(NamedCall("f"), []) == ("", [("f", "")])


@pytest.mark.parametrize("text, end", [('{"a": [1]} x', 10), ('"s\\"}" x', 6), ("12, ", 2), ("true}", 4),
                                       (' [1, "]"] ', 9), ("nul", None), ('{"a": "}', None)])
def test_json_end_finds_the_end_of_a_value(text, end):
    assert JsonEnd().feed(text) == end
    scan, fed = JsonEnd(), None       # fed one character at a time: the same place
    for i, c in enumerate(text):
        taken = scan.feed(c)
        if taken is not None:
            fed = i + taken
            break
    assert fed == end


def test_the_format_is_read_from_the_chat_template():
    assert detect("{{ '<tool_call>' }}{% for t in tools %}{% endfor %}") == "hermes"
    assert detect("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect("<|im_start|>{{ message.content }}") is None
    assert detect(None) is None
