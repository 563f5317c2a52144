"""Where ``blink serve`` takes its API key from: the option, a file, or the environment."""
from __future__ import annotations

import os
from pathlib import Path


def api_key_from(option: str | None, path: str | None) -> str | None:
    """The API key of ``--api-key``, of ``--api-key-file`` (the file's text without surrounding whitespace) or,
    without either, of ``$BLINK_API_KEY`` (vLLM's is VLLM_API_KEY); None: no key. ``--api-key`` shows the key to
    every local user (``ps``, /proc/PID/cmdline); the file and the environment do not."""
    if option is not None and path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if path is None:
        return option or os.environ.get("BLINK_API_KEY") or None
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read the key ({e})") from None
    if not key:
        raise ValueError(f"--api-key-file {path} is empty: write the API key in it")
    return key
