"""OpenAI's function tools on /v1/chat/completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` parsed into
a ``ToolRequest`` (``ToolFields``), the grammar a forced choice answers in, and ``ToolAnswer``: one choice's text as
OpenAI's ``tool_calls``, streamed as deltas and whole as the message those same deltas add up to.

- ``tool_choice`` "auto" (the default when tools are given): the model decides; its text is read in the server's call
  format (``tool_parsers``: ``--tool-call-parser``, or the one its chat template teaches). "none": the model is shown
  the tools, its text is content.
- "required" and ``{"type": "function", "function": {"name": ...}}`` are forced through the structured-output grammar,
  as vLLM does, so they work with any model and any call format: a named function's answer is its ``parameters``
  schema, which becomes that call's arguments; "required" answers a JSON array (at least one item, at most one when
  ``parallel_tool_calls`` is false) of ``{"name": <a tool's name>, "parameters": <that tool's schema>}``.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from blink.nic.grammars import GrammarError, StructuredOutputs
from blink.nic.openai.errors import ApiError
from blink.nic.openai.tool_parsers import FORMATS, Arguments, CallStart, NamedCall, RequiredCalls
from blink.ring.request import shown

MAX_TOOLS = 128                                 # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")       # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}    # a function given without parameters takes none
CHOICE_RULE = ('"auto", "none", "required" or {"type": "function", "function": {"name": ...}} naming one of '
               "'tools'")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: ``tools`` as the chat template gets them (OpenAI's tool objects, validated),
    ``choice`` "auto", "none", "required" or the name of the function to call, ``parallel`` whether an answer may
    make several calls, and ``format`` the server's call format (a key of ``tool_parsers.FORMATS``) for "auto"."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool = True
    format: str | None = None

    def __post_init__(self):
        if self.choice not in ("auto", "none", "required", *self.names()):
            raise ValueError(f"ToolRequest.choice must be auto, none, required or a tool's name (got {self.choice!r})")
        if self.choice == "auto" and self.format not in FORMATS:
            raise ValueError(f"ToolRequest.format must be one of {list(FORMATS)} for choice auto (got {self.format!r})")

    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def parameters(self, i: int) -> dict:
        return self.tools[i]["function"].get("parameters") or NO_PARAMETERS

    def forced(self) -> tuple[str, StructuredOutputs] | None:
        """The grammar a forced choice answers in, with the field a refusal of it names; None for auto and none."""
        if self.choice in ("auto", "none"):
            return None
        if self.choice != "required":
            i = self.names().index(self.choice)
            return _spec(f"tools[{i}].function.parameters", self.parameters(i))
        defs, calls = {}, []
        for i, name in enumerate(self.names()):
            parameters = dict(self.parameters(i))
            # A schema's $refs point at its root's $defs: every tool's move up to the array's root.
            for key, definition in parameters.pop("$defs", {}).items():
                if defs.setdefault(key, definition) != definition:
                    raise ApiError(400, f"'tools[{i}].function.parameters.$defs.{key}' differs from another tool's "
                                        f"definition of the same name: with tool_choice \"required\" every tool's "
                                        f"schema is one grammar, so give the definitions distinct names",
                                   param=f"tools[{i}].function.parameters")
            calls.append({"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters},
                          "required": ["name", "parameters"]})
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                  **({} if self.parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}
        return _spec("tools", schema)

    def parser(self):
        """A fresh reader of one answer's calls (``tool_parsers``), or None when its text is all content."""
        if self.choice == "none":
            return None
        if self.choice == "auto":
            return FORMATS[self.format](None if self.parallel else 1)
        return RequiredCalls() if self.choice == "required" else NamedCall(self.choice)


def _spec(param: str, schema: dict) -> tuple[str, StructuredOutputs]:
    try:
        return param, StructuredOutputs.json(schema)
    except GrammarError as e:
        raise ApiError(400, f"'{param}' {e}", param=param) from None


class ToolFields:
    """Reads a chat body's tool fields for a server whose models write calls in ``format`` (None: unknown) and
    whose chat template ``renders_tools`` (shows the model the tools offered)."""

    def __init__(self, format: str | None, renders_tools: bool):
        if format is not None and format not in FORMATS:
            raise ValueError(f"the tool call format must be one of {list(FORMATS)} (got {format!r})")
        self.format, self.renders_tools = format, renders_tools

    def request(self, body: dict) -> ToolRequest | None:
        """The body's ``ToolRequest``, or None when it offers no tools; 400 naming the field that is wrong."""
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise ApiError(400, f"'parallel_tool_calls' must be a boolean (got {shown(parallel)})",
                           param="parallel_tool_calls")
        tools = tool_list(body)
        choice = body.get("tool_choice")
        if not tools:
            if choice not in (None, "none"):
                raise ApiError(400, f"'tool_choice' {shown(choice)} needs 'tools': offer the functions to call, or "
                                    "leave tool_choice out", param="tool_choice")
            return None
        choice = _choice(choice, [tool["function"]["name"] for tool in tools])
        if choice == "auto":
            self._check_auto()
        return ToolRequest(tuple(tools), choice, parallel is not False, self.format if choice == "auto" else None)

    def _check_auto(self) -> None:
        forced = 'or send tool_choice "required" or a named function, which work with any model'
        if self.format is None:
            raise ApiError(400, "'tool_choice' is \"auto\" (the default with 'tools'), but this server does not "
                                "know the format its model writes tool calls in: start it with --tool-call-parser "
                                f"{' or '.join(FORMATS)}, {forced}", param="tool_choice")
        if not self.renders_tools:
            raise ApiError(400, "'tools' cannot be shown to the model: its chat template never reads them, so with "
                                "tool_choice \"auto\" it would not know them: start the server with --chat-template "
                                f"and a template that renders 'tools', {forced}", param="tools")


def tool_list(body: dict) -> list[dict]:
    """The body's ``tools``, each ``{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}`` with a distinct name ([] when absent); 400 naming the first field that is wrong."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of at most {MAX_TOOLS} tools (got {shown(tools)})",
                       param="tools")
    seen = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f"'{param}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"parameters\": {{...}}}}}} (got {shown(tool)})", param=param)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ApiError(400, f"'{param}.function.name' must be 1 to 64 letters, digits, '_' or '-' "
                                f"(got {shown(name)})", param=f"{param}.function.name")
        if name in seen:
            raise ApiError(400, f"'{param}.function.name' {name!r} names an earlier tool too: give each tool its own "
                                "name", param=f"{param}.function.name")
        seen.add(name)
        for field, kind, rule in (("description", str, "a string"), ("parameters", dict, "a JSON schema (an object)"),
                                  ("strict", bool, "a boolean")):
            if function.get(field) is not None and not isinstance(function[field], kind):
                raise ApiError(400, f"'{param}.function.{field}' must be {rule} (got {shown(function[field])})",
                               param=f"{param}.function.{field}")
    return tools


def _choice(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict):
        raise ApiError(400, f"'tool_choice' must be {CHOICE_RULE} (got {shown(choice)})", param="tool_choice")
    if function.get("name") not in names:
        raise ApiError(400, f"'tool_choice.function.name' must name one of 'tools' ({', '.join(names)}) (got "
                            f"{shown(function.get('name'))})", param="tool_choice.function.name")
    return function["name"]


class ToolAnswer:
    """One choice's text read for tool calls (``parser``: ``ToolRequest.parser()``): ``deltas`` turns each piece
    of it into OpenAI chat deltas: ``{"content"}``, a call's first ``{"tool_calls": [{"index", "id", "type",
    "function": {"name", "arguments": ""}}]}``, then ``{"tool_calls": [{"index", "function": {"arguments"}}]}``
    with the arguments' next fragment. ``message`` of all of them is the whole answer's message."""

    def __init__(self, parser):
        self.parser = parser
        self.calls = 0

    def deltas(self, text: str, final: bool) -> list[dict]:
        events = self.parser.push(text) if text else []
        if final:
            events += self.parser.finish()
        deltas = []
        for event in events:
            if isinstance(event, CallStart):
                deltas.append({"tool_calls": [{"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                                               "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
                self.calls += 1
            elif isinstance(event, Arguments):
                deltas.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": event.text}}]})
            elif event:
                deltas.append({"content": event})
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """An answer that ended by itself having made calls finished for them."""
        return "tool_calls" if self.calls and reason == "stop" else reason


def message(deltas: list[dict]) -> dict:
    """The assistant message ``deltas`` (``ToolAnswer.deltas``) add up to: content null when it only calls."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": calls}
