"""RDMA transport (RC queue pair, RDMA WRITE/READ into a dma-buf GPU memory region), built on pyverbs.

Only the import guard lives here for now; the RDMA data path is a later issue. pyverbs is imported lazily so that
``import blink`` never needs rdma-core.
"""
from __future__ import annotations

import importlib


def require_pyverbs():
    """Import and return ``pyverbs``, or raise ``ImportError`` saying what is missing and how to get it."""
    try:
        return importlib.import_module("pyverbs")
    except ImportError as e:
        raise ImportError(
            "the RDMA transport needs pyverbs (the Python bindings of rdma-core), which is not importable here "
            f"({e}). Install rdma-core's python3-pyverbs package (Debian/Ubuntu: apt install python3-pyverbs) on "
            "the NIC host, or use the SharedMemory transport on a single host.") from e

