"""Chat messages shaped for the template: an assistant's tool calls with their arguments as objects (what
transformers' templates read), a tool result's id, and a 400 naming the field that is wrong."""
import pytest

from blink.nic.openai.errors import ApiError
from blink.nic.openai.messages import chat_messages

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_calls_and_their_results_are_shaped_for_the_template():
    messages = chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C"},
        {"role": "assistant", "content": "Warm.", "refusal": None}])
    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "Warm."}]


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "c"}}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
     "messages[0].tool_calls[0]"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "[1, 2]"}}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None}, "messages[0].content"),
    ({"role": "tool", "content": "22 C", "tool_call_id": 7}, "messages[0].tool_call_id"),
])
def test_a_malformed_message_is_a_400_naming_its_field(message, param):
    with pytest.raises(ApiError) as error:
        chat_messages([message])
    assert (error.value.status, error.value.param) == (400, param)
