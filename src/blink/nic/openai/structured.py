"""Structured outputs in a request body: OpenAI's ``response_format`` and vLLM's ``structured_outputs``, parsed into a
``StructuredOutputs`` and compiled into the request's ``Grammar`` (``blink.nic.grammars``).

- ``response_format``: ``{"type": "text"}`` (nothing asked), ``{"type": "json_object"}`` (any JSON object), or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- ``structured_outputs``: exactly one of ``{"json": schema}``, ``{"regex": "..."}``, ``{"choice": [...]}``,
  ``{"json_object": true}``.

A ``tool_choice`` that forces a call (``blink.nic.openai.tools``) answers in a grammar too, and then neither may ask
for one. A refusal is a 400 naming the field that carries what was refused (``response_format``,
``structured_outputs.regex``, ``tools[0].function.parameters``, ...).
"""
from __future__ import annotations

from blink.nic.grammars import GrammarCompiler, GrammarError, StructuredOutputs
from blink.nic.openai.errors import ApiError
from blink.ring.grammar import Grammar
from blink.ring.request import shown

FIELDS = ("response_format", "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
NO_TABLE = "this server has no grammar table: start it with --max-grammar-bytes N (> 0)"


def asks(body: dict) -> bool:
    """Whether ``body`` may ask for a structured output, or force a tool call through one (then parsing it may
    compile: not on the event loop)."""
    return any(body.get(name) is not None for name in FIELDS) or body.get("tool_choice") not in (None, "auto", "none")


class StructuredParser:
    """``grammar(body)``: the request's compiled grammar, or None; ``compiler`` is None on a ring without a grammar
    table, which refuses every structured output."""

    def __init__(self, compiler: GrammarCompiler | None):
        self.compiler = compiler

    def grammar(self, body: dict, forced: tuple[str, StructuredOutputs] | None = None) -> Grammar | None:
        """``forced``: the grammar a tool choice forces, with the field that carries it."""
        specs = []
        for name, parse in (("response_format", _response_format), ("structured_outputs", _structured_outputs)):
            if body.get(name) is not None:
                param, spec = parse(body[name])
                if spec is not None:
                    specs.append((param, spec))
        if len(specs) > 1:
            raise ApiError(400, "'response_format' and 'structured_outputs' both ask for a structured output: give "
                                "one of them", param="structured_outputs")
        if forced is not None and specs:
            raise ApiError(400, f"'tool_choice' {shown(body['tool_choice'])} forces a tool call, whose arguments "
                                f"follow the tool's schema, and '{specs[0][0].split('.')[0]}' asks for a structured "
                                "output too: give one of them", param="tool_choice")
        if forced is None and not specs:
            return None
        param, spec = forced or specs[0]
        if self.compiler is None:
            asked = "'tool_choice' forces a tool call through a grammar" if forced else \
                f"'{param}' asks for a structured output"
            raise ApiError(400, f"{asked}, but {NO_TABLE}", param="tool_choice" if forced else param)
        try:
            return self.compiler.compile(spec)
        except GrammarError as e:
            raise ApiError(400, f"'{param}' {e}", param=param) from None


def _spec(param: str, make, *args) -> tuple[str, StructuredOutputs]:
    try:
        return param, make(*args)
    except GrammarError as e:
        raise ApiError(400, f"'{param}' {e}", param=param) from None


def _response_format(value) -> tuple[str, StructuredOutputs | None]:
    rule = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., '
            '"schema": {...}}}')
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise ApiError(400, f"'response_format' must be {rule} (got {shown(value)})", param="response_format")
    if value["type"] == "text":
        return "response_format", None
    if value["type"] == "json_object":
        return "response_format", StructuredOutputs("json_object", "")
    described = value.get("json_schema")
    if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
        raise ApiError(400, f"'response_format.json_schema' must be an object whose 'schema' is a JSON schema "
                            f"(got {shown(described)})", param="response_format.json_schema")
    for name, kind in (("name", str), ("strict", bool), ("description", str)):
        if described.get(name) is not None and not isinstance(described[name], kind):
            raise ApiError(400, f"'response_format.json_schema.{name}' must be a {kind.__name__} (got "
                                f"{shown(described[name])})", param=f"response_format.json_schema.{name}")
    return _spec("response_format.json_schema.schema", StructuredOutputs.json, described["schema"])


def _structured_outputs(value) -> tuple[str, StructuredOutputs | None]:
    rule = 'an object with one of "json" (a schema), "regex", "choice" (a list of strings) or "json_object": true'
    if not isinstance(value, dict):
        raise ApiError(400, f"'structured_outputs' must be {rule} (got {shown(value)})", param="structured_outputs")
    given = {name: v for name, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - {"json", "regex", "choice", "json_object"})
    if unknown:
        raise ApiError(400, f"'structured_outputs.{unknown[0]}' is not supported by this server: use {rule}",
                       param=f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise ApiError(400, f"'structured_outputs' must be {rule}, exactly one (got {shown(value)})",
                       param="structured_outputs")
    (name, v), = given.items()
    param = f"structured_outputs.{name}"
    if name == "json":
        return _spec(param, StructuredOutputs.json, v)
    if name == "choice":
        return _spec(param, StructuredOutputs.choice, v)
    if name == "regex" and isinstance(v, str) and v:
        return param, StructuredOutputs("regex", v)
    if name == "json_object" and v is True:
        return param, StructuredOutputs("json_object", "")
    rule = "a non-empty string" if name == "regex" else "true"
    raise ApiError(400, f"'{param}' must be {rule} (got {shown(v)})", param=param)
