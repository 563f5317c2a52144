"""The ring's secret: how an agent knows that the shared-memory ring it is given is its engine's, and not a ring
another engine left or made under that name.

The engine takes the secret from ``$BLINK_RING_SECRET``, or makes a random one, and hands it over out of band: in
the key file ``/dev/shm/NAME.key`` (mode 0600, made before the ring and removed with it), while the ring's control
block holds only its digest (``secret_digest``). The agent takes ``$BLINK_RING_SECRET`` if set (an agent that cannot
see the engine's ``/dev/shm``, e.g. in another container), else the key file, which it reads only if it is its own
user's with mode 0600 (``transport.check_owned``), and attaches only if the digests are equal. Run as the same user
in two shells, ``blink engine --ring NAME`` and ``blink agent --ring NAME`` need nothing more; another user can
neither read the key nor make one the agent accepts.

An agent that attaches through the engine's listener (``blink agent --remote``) takes the secret from the same
places (``given``): ``$BLINK_RING_SECRET``, else the key file of the ring name it is given. The engine's listener
takes it from where the engine put it: its key file, or ``$BLINK_RING_SECRET``, which an engine whose ring has no
name must have. The secret itself never crosses the connection: each side proves it (``blink.nic.remote.proof``).
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets

from blink.ring import control
from blink.ring.errors import RingRefused
from blink.ring.transport import SharedMemory, check_owned

ENV = "BLINK_RING_SECRET"
SUFFIX = ".key"


def digest(secret: str) -> int:
    """What the control block holds of ``secret`` (never 0, which means none): enough to check it, nothing to
    recover it from."""
    return int.from_bytes(hashlib.sha256(secret.encode()).digest()[:8], "little") or 1


def key_path(name: str) -> str:
    return os.path.join(SharedMemory.SHM_DIR, name + SUFFIX)


def publish(name: str) -> str:
    """The engine's side, before it makes the ring ``name``: the secret (``$BLINK_RING_SECRET`` or a random one),
    written to the key file, which must not exist (``FileExistsError``)."""
    secret = os.environ.get(ENV) or secrets.token_hex(16)
    path = key_path(name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(f"the ring's key file {path} exists already: another engine uses the name "
                              f"{name!r}, or a killed one left it behind; pick another name, or remove the file if "
                              "no engine runs on it") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def read(name: str) -> str:
    """The agent's side: ``$BLINK_RING_SECRET``, else the key file of ring ``name`` (``RingRefused`` if there is
    none, or it is not this user's alone)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    path = key_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ELOOP):
            raise
        raise RingRefused(f"no key file {path} beside the ring, as its engine makes: it is not a blink engine's "
                          f"ring, or its engine runs where this agent cannot see its /dev/shm (then set {ENV} to "
                          "the engine's secret for both)") from None
    with os.fdopen(fd) as f:
        check_owned(f.fileno(), path)
        return f.read()


def given(name: str | None) -> str | None:
    """The secret of the ring ``name`` as ``read`` finds it, or, without a name, ``$BLINK_RING_SECRET`` if set
    (None if not)."""
    return read(name) if name is not None else os.environ.get(ENV) or None


def verify(memory, secret: str, name: str) -> None:
    """``RingRefused`` unless the ring in ``memory`` holds the digest of ``secret``."""
    block = control.decode(memory.read(0, control.CONTROL_DTYPE.itemsize))
    if not hmac.compare_digest(int(block["secret_digest"]).to_bytes(8, "little"), digest(secret).to_bytes(8, "little")):
        raise RingRefused(f"the ring {name!r} was not made with this agent's secret (the key file beside it, or "
                          f"{ENV}): it is not the engine's whose secret this is; not attached")


def remove(name: str) -> None:
    try:
        os.unlink(key_path(name))
    except FileNotFoundError:
        pass
