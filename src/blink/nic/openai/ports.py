"""Where the HTTP server listens: the error a port that cannot be listened on gives (``cannot_listen``), and the
port several agent processes of one server listen on together (``reserve_port``, ``blink serve
--agent-processes``)."""
from __future__ import annotations

import socket


def cannot_listen(host: str, port: int, error: OSError) -> ValueError:
    """A port in use, an address this host does not have: the operator's to change."""
    return ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}: choose another --host or --port")


def reserve_port(host: str, port: int) -> socket.socket:
    """The port that several agent processes will listen on together, checked free (no other server listens on it,
    which SO_REUSEPORT would let them share with it) and chosen if ``port`` is 0; the socket returned holds it,
    bound with SO_REUSEPORT but not listening (it takes no connection), while the agent processes come and go."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.create_server((host, port), family=family) as probe:
            port = probe.getsockname()[1]
        held = socket.socket(family, socket.SOCK_STREAM)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host, port))
    except OSError as e:
        raise cannot_listen(host, port, e) from None
    return held
