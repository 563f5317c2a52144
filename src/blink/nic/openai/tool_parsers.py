"""Tool calls read from a chat answer's text as it streams.

Every parser has one interface: ``push(text)`` with each piece of the answer's text and ``finish()`` at its end
return events, in order: a ``str`` is content, ``CallStart(name)`` opens the next tool call (its index: the calls
opened before it), ``Arguments(text)`` appends to the open call's arguments (a JSON text once the call is complete).
Invariant: the events' concatenation does not depend on how the text is cut into pieces, so a streamed answer and a
whole one agree; text that may still turn out to be markup is held until the next pieces decide it.

The formats a model writes calls in, for ``tool_choice`` "auto" (``--tool-call-parser``, ``FORMATS``):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of
  them among the text (the closing tag may be left out at the end of the answer);
- ``llama3_json`` (Llama 3.1 to 3.3): the answer is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
  optionally after ``<|python_tag|>``, several separated by ``;``; text after the last call is content.

A call whose JSON is malformed, or is not an object with a string ``name`` and object arguments, is content,
markup included. A call is announced once it is complete and parsed (its arguments in one ``Arguments``), and the
whitespace touching a call is not content. ``NamedCall`` and ``RequiredCalls`` read the answers that ``tool_choice``
"required" and a named function force (``blink.nic.openai.tools``): there the grammar guarantees the JSON, so their
arguments stream as they are generated.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CallStart:
    name: str


@dataclass(frozen=True)
class Arguments:
    text: str


class JsonEnd:
    """Where the JSON value at the start of a text ends, the text fed in pieces: ``feed(piece)`` returns how many
    characters of ``piece`` complete the value once it is complete (None while it goes on; whitespace before it
    counts). Tracks nesting and strings only: the value's syntax is checked by whoever parses it. A number or a
    literal ends before the first character that cannot continue it."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.bare = 0, False, False, False

    def feed(self, piece: str) -> int | None:
        for i, c in enumerate(piece):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif self.bare:
                if c in ",]} \t\r\n":
                    return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif self.depth == 0 and not c.isspace():
                self.bare = True
        return None


def _call(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments as JSON)`` of a call object's JSON ``text``, or None if it is not one."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = [call[key] for key in arguments_keys if key in call]
    if len(arguments) != 1 or not isinstance(arguments[0], dict):
        return None
    return call["name"], json.dumps(arguments[0], ensure_ascii=False)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class TextCalls:
    """What the ``auto`` formats share: content with the whitespace that touches a call left out, at most
    ``max_calls`` calls (the rest are dropped: ``parallel_tool_calls`` false), and the text not yet decided."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.calls = 0
        self._events: list = []
        self._pending = ""          # text received and not yet decided
        self._space = ""            # whitespace after the last content: content, unless a call follows
        self._after_call = False    # whitespace now touches the call before it

    def push(self, text: str) -> list:
        self._pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list:
        self._run(final=True)
        if self._space:
            self._events.append(self._space)
            self._space = ""
        return self._take()

    def _take(self) -> list:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if body:
            self._events.append(self._space + body)
            self._space = text[len(body):]
        else:
            self._space += text

    def _emit_call(self, name: str, arguments: str) -> None:
        self._space, self._after_call = "", True
        if self.max_calls is None or self.calls < self.max_calls:
            self._events += [CallStart(name), Arguments(arguments)]
        self.calls += 1

    def _run(self, final: bool) -> None:
        raise NotImplementedError


class Hermes(TextCalls):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._in_call = False
        self._start = None          # where the call's object starts in the pending text
        self._end = None            # where it ends, once it has
        self._call = None           # (name, arguments) of that object
        self._scan, self._scanned = JsonEnd(), 0

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One decision about the pending text; whether another may follow."""
        text = self._pending
        if not self._in_call:
            at = text.find(self.OPEN)
            if at < 0:
                keep = 0 if final else _held_prefix(text, self.OPEN)
                self._content(text[:len(text) - keep])
                self._pending = text[len(text) - keep:]
                return False
            self._content(text[:at])
            self._pending, self._in_call = text[at + len(self.OPEN):], True
            self._start, self._end, self._scan, self._scanned = None, None, JsonEnd(), 0
            return True
        if self._start is None:
            body = text.lstrip()
            if not body:
                return self._malformed() if final else False
            if body[0] != "{":
                return self._malformed()
            self._start = self._scanned = len(text) - len(body)
        if self._end is None:
            return self._scan_object(final)
        rest = text[self._end:].lstrip()
        if rest.startswith(self.CLOSE) or (final and self.CLOSE.startswith(rest)):
            self._emit_call(*self._call)
            self._pending = rest[len(self.CLOSE):]
            self._in_call = False
            return True
        if self.CLOSE.startswith(rest):
            return False            # the closing tag may be on its way
        return self._malformed()

    def _scan_object(self, final: bool) -> bool:
        text = self._pending
        end = self._scan.feed(text[self._scanned:])
        if end is None:
            # An unfinished object that the closing tag follows is no call (it would swallow the next ones).
            closed = text.find(self.CLOSE, max(self._start, self._scanned - len(self.CLOSE)))
            self._scanned = len(text)
            return self._malformed() if final or closed >= 0 else False
        self._end = self._scanned + end
        self._call = _call(text[self._start:self._end], ("arguments",))
        return True if self._call is not None else self._malformed()

    def _malformed(self) -> bool:
        """The opening tag starts no call: it is content, and the text after it is read again as content."""
        self._content(self.OPEN)
        self._in_call = False
        return True


class Llama3Json(TextCalls):
    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        # lead: before the first call; call: at a call's object; between: after a call; content: the rest
        self._state = "lead"
        self._held = ""             # lead: the whitespace (and tag) before the first object; call: from the ';'
        self._tagged = False
        self._scan, self._scanned = JsonEnd(), 0

    def _run(self, final: bool) -> None:
        steps = {"lead": self._at_lead, "call": self._at_call, "between": self._at_between,
                 "content": self._at_content}
        while (self._pending or final) and steps[self._state](final):
            pass

    def _at_lead(self, final: bool) -> bool:
        text = self._pending
        body = text.lstrip()
        if body.startswith(self.TAG) and not self._tagged:
            self._held += text[:len(text) - len(body) + len(self.TAG)]
            self._pending, self._tagged = body[len(self.TAG):], True
            return True
        if body.startswith("{"):
            self._held += text[:len(text) - len(body)]
            self._pending, self._state = body, "call"
            return True
        if not final and (not body or (self.TAG.startswith(body) and not self._tagged)):
            return False
        return self._to_content()

    def _at_call(self, final: bool) -> bool:
        text = self._pending
        end = self._scan.feed(text[self._scanned:])
        if end is None:
            self._scanned = len(text)
            return self._to_content() if final else False
        end += self._scanned
        call = _call(text[:end], ("parameters", "arguments"))
        if call is None:
            return self._to_content()
        self._emit_call(*call)
        self._pending, self._held, self._state = text[end:], "", "between"
        self._scan, self._scanned = JsonEnd(), 0
        return True

    def _at_between(self, final: bool) -> bool:
        body = self._pending.lstrip()
        if not body:
            return False
        if body[0] != ";":
            return self._to_content()
        after = body[1:].lstrip()
        if after.startswith("{"):
            self._held, self._pending, self._state = body[:len(body) - len(after)], after, "call"
            return True
        if after:
            return self._to_content()
        if final:
            self._pending = ""      # a ';' after the last call separates nothing
        return False

    def _to_content(self) -> bool:
        """What is held and pending is content, and so is all the text after it."""
        self._pending, self._held, self._state = self._held + self._pending, "", "content"
        return True

    def _at_content(self, final: bool) -> bool:
        self._content(self._pending)
        self._pending = ""
        return False


class NamedCall:
    """The answer is the arguments of one call to ``name`` (``tool_choice`` naming a function)."""

    def __init__(self, name: str):
        self._start = [CallStart(name)]

    def push(self, text: str) -> list:
        events, self._start = self._start, []
        return events + [Arguments(text)] if text else events

    def finish(self) -> list:
        return self.push("")


class RequiredCalls:
    """The answer is a JSON array of ``{"name": ..., "parameters": {...}}`` (``tool_choice`` "required"), each item
    a call whose arguments stream as they come. The grammar writes the keys in this order."""

    HEAD = re.compile(r'[\s}]*[\[,]\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"parameters"\s*:\s*')

    def __init__(self):
        self._pending = ""
        self._scan = None           # the open call's arguments: where they end

    def push(self, text: str) -> list:
        self._pending += text
        events = []
        while True:
            if self._scan is None:
                head = self.HEAD.match(self._pending)
                if head is None or head.end() == len(self._pending):     # whitespace may still come
                    return events
                events.append(CallStart(head[1]))
                self._pending, self._scan = self._pending[head.end():], JsonEnd()
            end = self._scan.feed(self._pending)
            if end is None:
                events.append(Arguments(self._pending))
                self._pending = ""
                return events
            events.append(Arguments(self._pending[:end]))
            self._pending, self._scan = self._pending[end:], None

    def finish(self) -> list:
        return []


FORMATS = {"hermes": Hermes, "llama3_json": Llama3Json}


def detect(template: str | None) -> str | None:
    """The call format a chat template teaches its model, or None: a template that writes ``<tool_call>`` is Hermes';
    a Llama 3 one (its header tokens and ``<|python_tag|>`` or the ``ipython`` role) is ``llama3_json``."""
    if not template:
        return None
    if Hermes.OPEN in template:
        return "hermes"
    if "<|start_header_id|>" in template and (Llama3Json.TAG in template or "ipython" in template):
        return "llama3_json"
    return None
