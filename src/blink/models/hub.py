"""Model names as users give them: a directory, or a Hugging Face model id found in the local hub cache (offline:
blink never downloads).

The cache is laid out by huggingface_hub: ``$HF_HUB_CACHE`` (or ``$HF_HOME/hub``, or ``~/.cache/huggingface/hub``)
holds ``models--ORG--NAME/refs/REVISION`` (a commit hash) and ``models--ORG--NAME/snapshots/HASH/`` (the files).
"""
from __future__ import annotations

import os
from pathlib import Path

from blink.errors import ConfigError

from .default import default_model_path


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return home / "hub"


def resolve_model(name: str | None, revision: str = "main", cache: Path | str | None = None) -> Path:
    """The directory of ``name``: itself if it is one, else the snapshot of the model id ``name`` at ``revision`` (a
    branch, tag or commit) in the hub cache ``cache`` (default: ``hub_cache()``); None is the embedded default model."""
    if name is None:
        return default_model_path()
    cache = hub_cache() if cache is None else Path(cache).expanduser()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:    # a path, not an ORG/NAME model id
        raise ConfigError(f"{path}: no such file or directory (a model is a directory with a config.json, or a "
                          f"model id ORG/NAME in the local Hugging Face cache)")
    repo = cache / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / revision
    snapshot = repo / "snapshots" / (ref.read_text().strip() if ref.is_file() else revision)
    if name.count("/") == 1 and snapshot.is_dir():
        return snapshot
    raise FileNotFoundError(
        f"model {name!r} is neither a directory nor a model id in the local Hugging Face cache ({cache}, "
        f"revision {revision!r}): blink resolves model ids from the local cache only, without a network; download "
        f"it there first (huggingface-cli download {name}) or pass its directory")
