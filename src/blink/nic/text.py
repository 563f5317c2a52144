"""The agent's text side: tokenizer, chat template, stop strings and the max_tokens rule (the incremental detokenizer:
``blink.nic.detokenizer``).

Everything here is pure CPU work on the NIC side; the GPU only ever sees token ids. A model directory in the HF layout
provides ``tokenizer.json`` (read with the ``tokenizers`` library), ``tokenizer_config.json`` (chat template, special
tokens), and optionally ``generation_config.json`` (EOS ids) and ``config.json`` (context length).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from blink.nic.detokenizer import detokenizer_for
from blink.nic.token_bytes import decoded_bytes, vocabulary_bytes

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_MARK = "\U000f0000"         # a private-use character: where a message's content goes in a rendered template
_ROLES = ("system", "user", "assistant")    # the roles whose cost per message is measured (Tokenizer.message_tokens)


class Tokenizer:
    """A model directory's tokenizer, its chat template, EOS ids and context length.

    ``encode(text)`` adds the model's special tokens (e.g. BOS) as ``transformers`` does for a plain prompt;
    ``encode_chat(messages)`` renders the chat template and encodes it without adding them again, as
    ``transformers``' ``apply_chat_template(tokenize=True)`` does (templates write BOS themselves).
    """

    def __init__(self, model_dir, *, chat_template: str | None = None, special_tokens_in_content: bool = True):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}: pass a model directory in the HF layout")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        # The default, as in transformers and vLLM: a special token's text inside a message is that special token.
        # Off, message contents are encoded with special tokens as plain text (a second tokenizer: the flag is
        # per tokenizer, and encoding runs in several threads).
        self._content_tokenizer = None
        if not special_tokens_in_content:
            self._content_tokenizer = tokenizers.Tokenizer.from_file(str(path))
            self._content_tokenizer.encode_special_tokens = True
        config = _read_json(model_dir / "tokenizer_config.json")
        self.special_tokens = {name: _token_content(config[name]) for name in _SPECIAL_TOKEN_NAMES
                               if config.get(name) is not None}
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._eos_ids(_read_json(model_dir / "generation_config.json"))
        model_config = _read_json(model_dir / "config.json")
        self.context_len: int | None = model_config.get("max_position_embeddings") or config.get("model_max_length")
        self.max_token_bytes = _max_token_bytes(self._tokenizer)
        added = self._tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.token_bytes = decoded_bytes(self._tokenizer)      # None unless the vocabulary is byte-level
        template = chat_template or _read_text(model_dir / "chat_template.jinja") \
            or _default_template(config.get("chat_template"))
        self.chat_template: str | None = template       # its source: the tool call format is read from it
        self._template = _compile_template(template) if template else None
        # Whether the template shows the model the tools a request offers (a template that never reads 'tools'
        # renders none of them, as transformers' apply_chat_template(tools=...) does then).
        self.renders_tools = self._template is not None and "tools" in jinja2.meta.find_undeclared_variables(
            self._template.environment.parse(template))
        self.message_tokens = self._message_tokens()

    def _message_tokens(self) -> int:
        """The fewest tokens a message adds to a rendered chat (5 for SmolLM2's template: its role and the
        template's markers), measured on empty messages of each role; 1 where the template takes none of them."""
        added = []
        for role in _ROLES:
            try:
                one, two = (len(self.encode_chat([{"role": role, "content": ""}] * k)) for k in (1, 2))
            except ValueError:
                continue
            added.append(two - one)
        return max(1, min(added, default=1))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return _encode(self._tokenizer, text, add_special_tokens)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def vocabulary_bytes(self) -> dict[bytes, list[int]]:
        """The ids of every non-special token by the bytes it stands for (``blink.nic.token_bytes``)."""
        return vocabulary_bytes(self._tokenizer)

    def token_strs(self, ids) -> list[str]:
        """Each id's token as the vocabulary writes it (byte-level: "Ġ" for a space), as ``transformers``'
        ``convert_ids_to_tokens`` gives them."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat template applied to ``messages`` and the function ``tools`` offered (OpenAI's tool objects, as
        transformers passes them; None: none). ``ValueError`` if there is no template or it rejects them."""
        if self._template is None:
            raise ValueError("this model has no chat template (chat_template.jinja, or 'chat_template' in "
                             "tokenizer_config.json): "
                             "use /v1/completions or pass a template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # What a template does with the request's values (a number added to a string, a missing key) is the
            # request's problem: a 400, never a 500.
            raise ValueError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from None

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        if self._content_tokenizer is None:
            return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools),
                               add_special_tokens=False)
        # Render with a marker in place of each content, then encode the template's text and the contents apart. An
        # empty content stays empty: a template may test it ("{% if message.content %}"), and a marker is not empty.
        marked = [{**m, "content": f"{_MARK}{i}{_MARK}"} if m.get("content") else m for i, m in enumerate(messages)]
        pieces = self.render_chat(marked, add_generation_prompt=add_generation_prompt, tools=tools).split(_MARK)
        ids = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            else:
                content = messages[int(piece)]["content"]
                ids += _encode(self._content_tokenizer, content, False) if content else []
        return ids

    def _eos_ids(self, generation_config: dict) -> tuple[int, ...]:
        """EOS ids of generation_config.json (an int or a list) plus the tokenizer's eos_token."""
        ids = generation_config.get("eos_token_id")
        ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        eos = self.special_tokens.get("eos_token")
        if eos is not None and self._tokenizer.token_to_id(eos) is not None:
            ids.add(self._tokenizer.token_to_id(eos))
        return tuple(sorted(ids))


class TextStream:
    """One request's output text: token ids in, deltas out, cut before the first stop string.

    Invariant: the concatenated deltas of ``push`` calls and ``finish()`` equal ``decode(ids)`` cut at the first
    occurrence of any stop string (the stop string itself is not emitted), or the whole decode if none occurs. A tail
    that could still grow into a stop string is held back until the next tokens decide it. Once ``stopped`` is True
    the request is over: the caller cancels its ring slot and ignores any later tokens.
    """

    def __init__(self, tokenizer: Tokenizer, stop=(), *, skip_special_tokens: bool = True):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings (got {list(stop)!r})")
        self.detokenizer = detokenizer_for(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        # Decoded, not yet emitted: a tail that could still grow into a stop string. The text already emitted is not
        # kept (a stop string cannot start inside it, see _advance), so a push costs the same at any length.
        self._held = ""
        self.stopped = False
        self.n_tokens = 0       # tokens consumed, up to and including the one that completed a stop string

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.n_tokens += 1
        return self._advance(self.detokenizer.push(token_id), final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self.detokenizer.flush(), final=True)

    def _advance(self, new_text: str, final: bool) -> str:
        if not self.stop:
            return new_text     # nothing to hold back or cut: most requests, and this runs for every token
        # A stop string cannot start inside emitted text, whose stop-prefix tail was held back: one found now lies
        # in the held tail and the new text.
        window = self._held + new_text
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if hits:
            window = window[:min(hits)]
            self.stopped = final = True
        end = len(window) if final else len(window) - self._stop_prefix_len(window)
        self._held = window[end:]
        return window[:end]

    def _stop_prefix_len(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(window)), 0, -1):
            tail = window[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


def max_tokens_for(requested: int | None, prompt_len: int, context_len: int, output_capacity: int,
                   field: str = "max_tokens") -> int:
    """The request's max_tokens: ``requested``, or all the room the context leaves when it is None.

    The room is ``min(context_len - prompt_len, output_capacity)``; ``ValueError`` (saying what to change, ``field``
    naming what the client sent) if the prompt leaves none or ``requested`` asks for more.
    """
    room = min(context_len - prompt_len, output_capacity)
    if room < 1:
        raise ValueError(f"the prompt has {prompt_len} tokens, which leaves no room to generate within the engine's "
                         f"max_model_len of {context_len} tokens: shorten the prompt")
    if requested is None:
        return room
    if requested > room:
        raise ValueError(f"{field}={requested} is too large: the prompt has {prompt_len} tokens, the engine's "
                         f"max_model_len is {context_len} and a request may generate at most {output_capacity}, so at "
                         f"most {room} tokens fit: lower {field} or shorten the prompt")
    return requested


def _encode(tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer``'s ids of ``text``, through ``encode_batch``, which lets go of the GIL while it works (``encode``
    held it: a 1 MB prompt stopped every other thread of the agent, its event loop included, for 2.6 s)."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _max_token_bytes(tokenizer: tokenizers.Tokenizer) -> int:
    """The most input bytes one token stands for: a byte-level vocabulary's token, one byte per character of its
    surface form (81 for SmolLM2, where its UTF-8 took 162); another's, the UTF-8 of its surface form; an added
    token's, its text's. Twice that where a normalizer may shrink the text before it is split."""
    byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max([len(t) if byte_level else len(t.encode()) for t in vocab] +
                  [len(t.content.encode()) for t in tokenizer.get_added_tokens_decoder().values()])
    return longest * (1 if tokenizer.normalizer is None else 2)


def _compile_template(source: str) -> jinja2.Template:
    """The template environment ``transformers`` renders chat templates in (sandboxed: templates are untrusted)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _default_template(value) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones of which "default" is used."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default")
    return value


def _token_content(value) -> str:
    """A special token is written as its text or as a serialised AddedToken ``{"content": ...}``."""
    return value["content"] if isinstance(value, dict) else value


def chat_template_argument(value: str | None) -> str | None:
    """``--chat-template``: a file's path (read) or the template itself, as vLLM takes it."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise FileNotFoundError(f"--chat-template {value!r} is neither a file nor a Jinja template (no '{{' in it)")
    return value


def _read_text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
