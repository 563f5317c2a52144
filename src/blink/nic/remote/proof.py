"""The setup handshake's proofs that each side knows the ring's secret (``blink.ring.secret``), made without sending
the secret and useless to replay.

The listener opens every connection with a ``Challenge``: a fresh random nonce. The agent's ``Hello`` carries a
nonce of its own and ``prove(secret, AGENT, challenge, nonce, content)``; the engine's ``Offer`` carries
``prove(secret, ENGINE, challenge, nonce, content)``, where ``content`` is the message itself with its proof
``BLANK`` (``blink.nic.remote.handshake``). Invariants:

- each proof is an HMAC-SHA256 keyed by the secret, over a fixed label and both nonces of this connection: it shows
  the secret was known, and nothing of the secret can be recovered from it but by guessing (so a secret must be
  long and random: ``secrets.token_hex(16)``, as the engine makes one);
- a ``Hello`` captured on one connection proves nothing on another, whose challenge differs; an ``Offer`` captured
  on one proves nothing to another agent, whose nonce differs;
- the labels differ, so neither side can send the other's proof back as its own;
- a proof covers every other field of its message (the agent's QP, the offered regions and their keys): whoever sits
  between the two sides cannot change one without the other side refusing the message.

Both nonces are ``NONCE_BYTES`` long (the wire format checks it), so the bytes an HMAC covers are unambiguous.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets

NONCE_BYTES = hashlib.sha256().digest_size      # as long as a proof: one pattern (HEX) checks both on the wire
HEX = re.compile(f"[0-9a-f]{{{2 * NONCE_BYTES}}}")
AGENT, ENGINE = b"blink handshake agent proof", b"blink handshake engine proof"
BLANK = "0" * (2 * NONCE_BYTES)     # a message's proof while its proof is made or checked


def nonce() -> str:
    """A fresh nonce: ``NONCE_BYTES`` random bytes in lower-case hex."""
    return secrets.token_hex(NONCE_BYTES)


def prove(ring_secret: str, label: bytes, challenge: str, nonce: str, content: bytes) -> str:
    """The proof of ``label``'s side that it knows ``ring_secret`` and sent ``content``, for the listener's
    ``challenge`` and the agent's ``nonce`` (both hex, as on the wire; fixed-length, so the bytes covered are
    unambiguous)."""
    message = label + b"\0" + bytes.fromhex(challenge) + bytes.fromhex(nonce) + content
    return hmac.new(ring_secret.encode(), message, hashlib.sha256).hexdigest()


def proves(proof: str | None, ring_secret: str, label: bytes, challenge: str, nonce: str, content: bytes) -> bool:
    """``proof`` is ``prove(ring_secret, label, challenge, nonce, content)`` (compared in constant time); None
    proves nothing."""
    return proof is not None and hmac.compare_digest(proof, prove(ring_secret, label, challenge, nonce, content))
