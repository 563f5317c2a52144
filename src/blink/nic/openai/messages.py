"""A chat body's ``messages`` checked and shaped for the chat template: text contents (a list of text parts joined),
an assistant's ``tool_calls`` with their arguments as objects (as transformers' templates read them, and as vLLM
hands them over), a tool result's ``tool_call_id``, and a message's ``name``; a 400 naming the first field that is
wrong otherwise."""
from __future__ import annotations

import json

from blink.nic.openai.errors import ApiError
from blink.ring.request import shown

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def text_field(value: str, param: str) -> str:
    """Tokenizers need valid Unicode: JSON can smuggle in unpaired surrogates (\\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' contains an unpaired UTF-16 surrogate: send valid Unicode text",
                       param=param) from None
    return value


def chat_messages(messages) -> list[dict]:
    """``messages`` as the chat template takes them: a non-empty list of {"role", "content"} (null only for an
    assistant's message that calls tools, given as ""), with "tool_calls", "tool_call_id" and "name" where given."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"'messages' must be a non-empty list of messages (got {shown(messages)})",
                       param="messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise ApiError(400, f"'{param}' must be an object with a 'role' in {list(CHAT_ROLES)} "
                            f"(got {shown(message)})", param=param)
    shaped = {"role": message["role"]}
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant":
            raise ApiError(400, f"'{param}.tool_calls' belongs to an assistant's message, not a "
                                f"{message['role']}'s", param=f"{param}.tool_calls")
        shaped["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if content is None and calls:
        shaped["content"] = ""      # templates that write every content (SmolLM2's) fail on None
    elif isinstance(content, str):
        shaped["content"] = text_field(content, f"{param}.content")
    else:
        raise ApiError(400, f"'{param}.content' must be a string or a list of text parts "
                            f"({{\"type\": \"text\", \"text\": ...}}); only text is supported (null only for an "
                            f"assistant's message with tool_calls) (got {shown(content)})", param=f"{param}.content")
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise ApiError(400, f"'{param}.{name}' must be a string (got {shown(message[name])})",
                               param=f"{param}.{name}")
            shaped[name] = text_field(message[name], f"{param}.{name}")
    return shaped


def _tool_calls(calls, param: str) -> list[dict]:
    """An assistant's calls ``{"id", "type": "function", "function": {"name", "arguments"}}``, each's arguments (a
    JSON object's text) parsed."""
    rule = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<a JSON object>"}}'
    if not isinstance(calls, list):
        raise ApiError(400, f"'{param}' must be a list of tool calls {rule} (got {shown(calls)})", param=param)
    shaped = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or call.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not isinstance(call.get("id", ""), str)):
            raise ApiError(400, f"'{param}[{j}]' must be {rule} (got {shown(call)})", param=f"{param}[{j}]")
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ApiError(400, f"'{param}[{j}].function.arguments' must be the text of a JSON object, as the call's "
                                f"answer gave it (got {shown(arguments)})", param=f"{param}[{j}].function.arguments")
        text_field(json.dumps(parsed, ensure_ascii=False), f"{param}[{j}].function.arguments")     # "\ud800" in it
        shaped.append({"id": call.get("id", ""), "type": "function",
                       "function": {"name": text_field(function["name"], f"{param}[{j}].function.name"),
                                    "arguments": parsed}})
    return shaped
