"""The process that compiles regular expressions into ``Grammar``s with outlines-core, so a compile that runs too long
or grows too large can be killed without harming the agent.

``serve(conn, vocabulary, eos_token_ids, vocab_size)`` answers ``(key, regex, max_bytes)`` messages on ``conn`` with
``("ok", grammar)`` or ``("error", message)`` until the pipe closes (after ``("ready", None)`` once the vocabulary is
built). The process limits its own address space
(``MEMORY_LIMIT_BYTES``): a grammar whose automaton outgrows it ends the process, which the agent reports as too
large.
"""
from __future__ import annotations

import resource

from blink.ring.grammar import RECORD_WORDS, build, mask_words

MEMORY_LIMIT_BYTES = 4 << 30


def serve(conn, vocabulary: dict[bytes, list[int]], eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
    from outlines_core import Index, Vocabulary

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    tokens = Vocabulary(min(eos_token_ids), vocabulary)
    conn.send(("ready", None))
    while True:
        try:
            key, regex, max_bytes = conn.recv()
        except EOFError:
            return
        try:
            index = Index(regex, tokens)
        except (ValueError, RuntimeError) as e:
            conn.send(("error", f"is not a regular expression this server can compile ({str(e).splitlines()[0]})"))
            continue
        transitions = index.get_transitions()
        smallest = len(transitions) * 4 * (mask_words(vocab_size) + RECORD_WORDS)
        if smallest > max_bytes:
            conn.send(("error", _too_large(len(transitions), smallest, max_bytes)))
            continue
        grammar = build(key, vocab_size, index.get_initial_state(), transitions,
                        index.get_final_states(), eos_token_ids)
        if grammar.nbytes > max_bytes:
            conn.send(("error", _too_large(grammar.n_states, grammar.nbytes, max_bytes)))
            continue
        conn.send(("ok", grammar))


def _too_large(states: int, nbytes: int, max_bytes: int) -> str:
    return (f"compiles to {states} automaton states taking at least {nbytes} bytes, more than the {max_bytes} this "
            "server's grammar table holds: simplify it, or start the server with a larger --max-grammar-bytes")
