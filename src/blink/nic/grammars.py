"""Structured outputs compiled into ``Grammar``s (``blink.ring.grammar``) for the served tokenizer.

``StructuredOutputs`` is what a request asks its output to match (vLLM's ``structured_outputs``): a JSON schema
(``json``), a regular expression (``regex``), one of a list of strings (``choice``) or any JSON object
(``json_object``). ``GrammarCompiler.compile`` turns it into a regular expression (outlines-core's
``build_regex_from_schema`` for a schema, with one optional space where JSON allows whitespace), then into a token
automaton with outlines-core's ``Index`` in a worker process (``grammar_worker``) that it kills when a compile runs
longer than ``timeout_s``. Compiled grammars are kept in an LRU by ``(kind, canonical text)`` whose grammars
together take at most ``max_bytes``; refusals are remembered too, so a schema that timed out costs its time once.

Every refusal is a ``GrammarError`` whose message is a predicate about the structured output ("is not valid JSON
(...)"), said of the request field that carries it; it says what was wrong and what to do. Thread-safe: compiles run one
at a time, and a lookup of a compiled grammar never waits for one.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import threading
from collections import OrderedDict
from dataclasses import dataclass

from blink.nic.grammar_worker import serve
from blink.ring.grammar import Grammar

KINDS = ("json", "regex", "choice", "json_object")
REFUSALS_KEPT = 256         # refused (kind, text) pairs remembered
MAX_CHOICES = 1024
WORKER_START_S = 60.0       # the worker imports numpy and outlines-core and builds the vocabulary
COMPILE_TIMEOUT_S = 30.0    # the longest one compile may take, by default (blink serve --grammar-timeout)


class GrammarError(ValueError):
    """A structured output this server cannot compile; the message says why and what to do."""


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match: ``kind`` (one of ``KINDS``) and its canonical ``text`` (a schema as
    compact JSON, the regular expression, the choices as a JSON list, "" for any JSON object)."""

    kind: str
    text: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"StructuredOutputs.kind must be one of {KINDS} (got {self.kind!r})")

    @classmethod
    def json(cls, schema) -> StructuredOutputs:
        """A JSON schema given as an object, or as the text of one."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"must be a JSON schema: an object (got {type(schema).__name__})")
        return cls("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, choices) -> StructuredOutputs:
        if not (isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in choices)):
            raise GrammarError(f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    def regex(self) -> str:
        """The regular expression (Rust ``regex`` syntax, anchored at both ends) the output must match."""
        if self.kind == "regex":
            return self.text
        if self.kind == "choice":
            return "(" + "|".join(_escaped(c) for c in json.loads(self.text)) + ")"
        if self.kind == "json_object":
            return json_object_regex()
        try:
            return _json_schema_module().build_regex_from_schema(self.text)
        except ValueError as e:
            raise GrammarError(f"is a JSON schema this server cannot compile ({str(e).splitlines()[0]}): structured "
                               "outputs support JSON Schema's types, properties, required, items, enum, const, "
                               "anyOf/oneOf/allOf, $ref, pattern, format and length and item bounds") from None


def _json_schema_module():
    """outlines-core's ``json_schema`` module (a dependency of blink); a ``GrammarError`` that names the install where
    the server's environment lacks it (the server keeps serving everything else)."""
    try:
        import outlines_core.json_schema
    except ModuleNotFoundError:
        raise GrammarError("asks for a structured output, but outlines-core, which compiles grammars, is not installed "
                           "where this server runs: pip install outlines-core (a dependency of blink) and restart "
                           "it") from None
    return outlines_core.json_schema


def _escaped(text: str) -> str:
    """``text`` as a regular expression that matches exactly it: every ASCII punctuation character escaped."""
    return "".join("\\" + c if c.isascii() and not c.isalnum() and c.isprintable() and c != " " else c
                   for c in text)


def json_object_regex() -> str:
    """Any JSON object whose values are scalars, or arrays or objects of scalars: two levels of nesting, which
    compiles in about a second (outlines-core's own regex of ``{"type": "object"}``, three levels, takes ten)."""
    js = _json_schema_module()
    STRING, NUMBER, S = js.STRING, js.NUMBER, js.WHITESPACE

    scalar = f"({STRING}|{NUMBER}|true|false|null)"
    array = rf"\[{S}({scalar}({S},{S}{scalar})*)?{S}\]"

    def obj(value: str) -> str:
        return rf"\{{{S}({STRING}{S}:{S}{value}({S},{S}{STRING}{S}:{S}{value})*)?{S}\}}"

    return obj(f"({scalar}|{array}|{obj(scalar)})")


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for ``tokenizer`` (a ``blink.nic.text.Tokenizer``) over the engine's vocabulary
    of ``vocab_size`` tokens (its logits' width, which may exceed the tokenizer's); ``max_bytes`` bounds one grammar
    and the cache together, ``timeout_s`` one compile."""

    def __init__(self, tokenizer, vocab_size: int, max_bytes: int, timeout_s: float):
        self.tokenizer, self.vocab_size, self.max_bytes, self.timeout_s = tokenizer, vocab_size, max_bytes, timeout_s
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()           # the cache and the refusals: held for lookups, never for a compile
        self._compiling = threading.Lock()      # the worker: one compile at a time
        self._worker = self._conn = None

    def compile(self, spec: StructuredOutputs) -> Grammar:
        if not self.tokenizer.eos_token_ids:        # a server of such a model still serves everything else
            raise GrammarError("asks for a structured output, but this model has no end-of-sequence token, so no "
                               "grammar could end (give its tokenizer an eos_token)")
        key = (spec.kind, spec.text)
        known = self._known(key)
        if known is not None:
            return known
        with self._compiling:
            known = self._known(key)           # compiled while this thread waited
            if known is not None:
                return known
            try:
                grammar = self._compile(key, spec.regex())
            except GrammarError as e:
                with self._lock:
                    self._refused[key] = str(e)
                    while len(self._refused) > REFUSALS_KEPT:
                        self._refused.popitem(last=False)
                raise
        with self._lock:
            self._cache[key] = grammar
            self._cached_bytes += grammar.nbytes
            while self._cached_bytes > self.max_bytes:
                self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return grammar

    def _known(self, key: tuple[str, str]) -> Grammar | None:
        """The cached grammar of ``key``, or None; ``GrammarError`` if it was refused."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if key in self._refused:
                raise GrammarError(self._refused[key])
        return None

    def _compile(self, key: tuple[str, str], regex: str) -> Grammar:
        conn = self._connection()
        conn.send((key, regex, self.max_bytes))
        if not conn.poll(self.timeout_s):
            self.close()
            raise GrammarError(f"did not compile within {self.timeout_s:g} s (its automaton is too large): "
                               "simplify it (fewer or shorter bounded repetitions such as maxLength, maxItems, "
                               "{m,n}; fewer alternatives)")
        try:
            status, value = conn.recv()
        except EOFError:
            code = self._worker.exitcode
            self.close()
            raise GrammarError(f"stopped the compiler (exit code {code}: out of memory, its automaton being too "
                               "large): simplify it") from None
        if status != "ok":
            raise GrammarError(value)
        return value

    def _connection(self):
        if self._worker is None or not self._worker.is_alive():
            self.close()
            context = mp.get_context("spawn")
            self._conn, theirs = context.Pipe()
            self._worker = context.Process(
                target=serve, args=(theirs, self.tokenizer.vocabulary_bytes(), self.tokenizer.eos_token_ids,
                                    self.vocab_size), name="blink-grammar-compiler", daemon=True)
            self._worker.start()
            theirs.close()
            if not self._conn.poll(WORKER_START_S):
                self.close()
                raise GrammarError(f"could not be compiled: the compiler did not start within {WORKER_START_S:g} s")
            self._conn.recv()       # ready
        return self._conn

    def close(self) -> None:
        """Stop the worker process (the next compile starts another)."""
        if self._worker is not None:
            self._worker.kill()
            self._worker.join()
            self._conn.close()
        self._worker = self._conn = None
