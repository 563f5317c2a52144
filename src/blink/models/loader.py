"""Checkpoints → models: HF-style directories of safetensors (one file, or shards with an index), or random weights.

Tensors are read one at a time from the memory-mapped files straight onto the model's device and copied (with dtype
conversion) into the preallocated, possibly fused, parameters: the checkpoint is never materialised whole on the CPU.
Every failure names the file, the tensor or the field that is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from blink.errors import CheckpointError

from .config import ModelConfig
from .decoder import DecoderLM, torch_dtype
from .llama import LlamaForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[DecoderLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "Phi3ForCausalLM": Phi3ForCausalLM}
LOADABLE_DTYPES = {"F32", "F16", "BF16"}
INDEX = "model.safetensors.index.json"


def build_model(config: ModelConfig, device="cpu", dtype: torch.dtype | str | None = None) -> DecoderLM:
    """A model with uninitialised weights; ``dtype`` defaults to the config's."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    return ARCHITECTURES[config.architecture](config, device, dtype)


def load_model(path: str | Path, device="cpu", dtype: torch.dtype | str | None = None) -> DecoderLM:
    """Load the HF-style model directory ``path`` (config.json + safetensors)."""
    model = build_model(ModelConfig.from_file(path), device, dtype)
    load_weights(model, Path(path))
    return model


def random_model(config: ModelConfig, device="cpu", dtype: torch.dtype | str | None = None,
                 seed: int = 0, std: float = 0.02) -> DecoderLM:
    """Weights ~ N(0, std) drawn on the device, norm weights 1: full-size shapes without a checkpoint."""
    model = build_model(config, device, dtype)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def checkpoint_targets(model: DecoderLM) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name → the view of a parameter it is copied into, for every tensor a checkpoint must provide.

    A fused parameter (``STACKED``) takes its parts as consecutive row ranges. A 3-D parameter stacks one matrix per
    expert: expert ``e``'s comes from ``<module>.<e>.<name>.<leaf>`` (``mlp.experts.3.up_proj.weight``).
    """
    targets = {}
    for name, param in model.named_parameters():
        head, _, leaf = name.rpartition(".")
        module, _, fused = head.rpartition(".")
        matrices = [(f"{module}.{e}", m) for e, m in enumerate(param)] if param.dim() == 3 else [(module, param)]
        parts = model.STACKED.get(fused)
        for prefix, matrix in matrices:
            if parts is None:
                targets[_join(prefix, fused, leaf)] = matrix
                continue
            row = 0
            for part, rows in zip(parts, model.shard_rows(fused, matrix)):
                targets[_join(prefix, part, leaf)] = matrix[row:row + rows]
                row += rows
    return targets


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names, or its ``*.safetensors``."""
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f}: shard named by {index} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX})")
    return files


def load_weights(model: DecoderLM, path: Path) -> None:
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        try:
            with safe_open(file, framework="pt", device=str(model.device)) as f:
                for name in f.keys():
                    if name in targets:
                        _copy_tensor(f, file, name, targets[name])
                        loaded.add(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: checkpoint lacks tensor(s) {', '.join(missing[:5])}{more}")


def _copy_tensor(f, file: Path, name: str, target: torch.Tensor) -> None:
    piece = f.get_slice(name)
    dtype = piece.get_dtype()
    if dtype not in LOADABLE_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; blink loads F32, F16 and BF16 weights")
    shape, want = tuple(piece.get_shape()), tuple(target.shape)
    if shape != want:
        raise CheckpointError(f"{file}: tensor {name} has shape {shape}, the config implies {want}")
    with torch.no_grad():
        target.copy_(f.get_tensor(name))
