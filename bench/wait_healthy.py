"""Wait until a server (``blink serve``, vLLM's) answers /health, for the serving scripts: ``python -m
bench.wait_healthy PORT PID LOG``.

Exits 0 once the server at 127.0.0.1:PORT is healthy; 1 (naming LOG, the server's log) if process PID exits first or
TIMEOUT_S pass.
"""
import http.client
import os
import sys
import time

TIMEOUT_S = 400


def healthy(port: int, timeout_s: float = 2) -> bool:
    """The server at 127.0.0.1:``port`` answers /health with 200."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


def main(port: int, pid: int, log: str) -> int:
    start = time.monotonic()
    while time.monotonic() - start < TIMEOUT_S:
        if healthy(port):
            print(f"the server on port {port} is healthy after {time.monotonic() - start:.0f} s")
            return 0
        if not os.path.exists(f"/proc/{pid}"):
            print(f"the server on port {port} exited before it was healthy: see {log}", file=sys.stderr)
            return 1
        time.sleep(1)
    print(f"the server on port {port} was not healthy within {TIMEOUT_S} s: see {log}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
