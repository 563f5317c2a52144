"""Where blink keeps what it builds once and reuses: ``$BLINK_CACHE_DIR``, default ``~/.cache/blink``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BLINK_CACHE_DIR") or Path.home() / ".cache" / "blink")
