"""Checkpoints → models: HF-style directories of safetensors (one file, or shards with an index), or random weights.

Tensors are read one at a time from the memory-mapped files straight onto the model's device and copied (with dtype
conversion) into the preallocated, possibly fused, parameters: the checkpoint is never materialised whole on the CPU.
A tensor-parallel rank (``parallel.TensorParallel``) reads only its slices of each tensor (``get_slice``).
Every failure names the file, the tensor or the field that is wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from blink.errors import CheckpointError, ConfigError

from .config import ModelConfig
from .decoder import DecoderLM, torch_dtype
from .llama import LlamaForCausalLM
from .parallel import Split, TensorParallel
from .phi3 import Phi3ForCausalLM
from .projection import Projection
from .e4m3 import FP8
from .quantization import check_ignored, requested
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[DecoderLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "Phi3ForCausalLM": Phi3ForCausalLM}
LOADABLE_DTYPES = {"F32", "F16", "BF16"}
FP8_DTYPE = "F8_E4M3"
INDEX = "model.safetensors.index.json"


def build_model(config: ModelConfig, device="cpu", dtype: torch.dtype | str | None = None,
                tp: TensorParallel = TensorParallel(), group=None) -> DecoderLM:
    """A model (rank ``tp.rank``'s share of it) with uninitialised weights; ``dtype`` defaults to the config's."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    return ARCHITECTURES[config.architecture](config, device, dtype, tp, group)


def load_model(path: str | Path, device="cpu", dtype: torch.dtype | str | None = None,
               tp: TensorParallel = TensorParallel(), group=None, quantization: str | None = None) -> DecoderLM:
    """Load the HF-style model directory ``path`` (config.json + safetensors), rank ``tp.rank``'s slices only.

    An FP8 checkpoint (``quantization_config``) loads as it is stored; ``quantization="fp8"`` quantizes the
    projections of a checkpoint that is not, after loading them in ``dtype`` (vLLM's ``--quantization fp8``:
    per-channel scales; the model-dtype weights are freed projection by projection)."""
    config = ModelConfig.from_file(path)
    quantized = requested(config, quantization)
    model = build_model(config, device, dtype, tp, group)
    load_weights(model, Path(path))
    if quantized is not config:
        model.quantize_(quantized.quantization)
    return model


def random_model(config: ModelConfig, device="cpu", dtype: torch.dtype | str | None = None,
                 seed: int = 0, std: float = 0.02, tp: TensorParallel = TensorParallel(), group=None) -> DecoderLM:
    """Weights ~ N(0, std) drawn on the device, norm weights 1: full-size shapes without a checkpoint.

    A rank draws every tensor at its full size, in the unsharded model's order, and keeps its slice: its weights are
    slices of the unsharded random model of the same seed, whatever the world size.
    An FP8 ``config.quantization`` draws the model-dtype weights, then quantizes them (``DecoderLM.quantize_``).
    """
    if config.quantization is not None:
        model = random_model(replace(config, quantization=None), device, dtype, seed, std, tp, group)
        model.quantize_(config.quantization)
        return model
    model = build_model(config, device, dtype, tp, group)
    full_shapes = [p.shape for p in build_model(config, "meta", dtype).parameters()]
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for (name, p), shape in zip(model.named_parameters(), full_shapes):
            if p.dim() == 1:
                p.fill_(1.0)
            elif p.shape == shape:  # the rank holds it whole: draw in place
                p.normal_(0.0, std, generator=gen)
            else:
                full = torch.empty(shape, device=p.device, dtype=p.dtype).normal_(0.0, std, generator=gen)
                split = model.weight_split(name)
                dim = split.dim + p.dim() - 2  # experts: the split cuts each expert's matrix
                for source, target in tp.pieces(split):
                    p[_along(dim, target)] = full[_along(dim, source)]
    return model


@dataclass
class Target:
    """Where a checkpoint tensor goes: its full ``shape`` (what the config implies) and the ``pieces`` of it this
    rank holds, as (index into the checkpoint tensor, the view of a parameter it is copied into). ``fp8``: an e4m3
    weight (the checkpoint must store ``F8_E4M3``); ``per_row``: a per-row scale, which the checkpoint may store as one
    value for its tensor (``()``, ``(1,)``: per-tensor) or one per row (``(rows,)``, ``(rows, 1)``: per-channel)."""

    shape: tuple[int, ...]
    pieces: list[tuple[tuple[slice, ...], torch.Tensor]] = field(default_factory=list)
    fp8: bool = False
    per_row: bool = False


def checkpoint_targets(model: DecoderLM) -> dict[str, Target]:
    """Checkpoint tensor name → its ``Target``, for every tensor a checkpoint must provide.

    A fused parameter takes its parts (``DecoderLM.weight_split``) as consecutive row ranges: from one checkpoint
    tensor each when ``STACKED`` names them, else from one tensor holding them all (Phi-3's ``qkv_proj``). Stacked
    experts hold one matrix per expert: expert ``e``'s comes from ``<module>.<e>.<name>.<leaf>``
    (``mlp.experts.3.up_proj.weight``). Under tensor parallelism each part gives the rank's slice of it. An FP8
    projection's scales follow its weight's rows (per-row scales) or its blocks of rows (block scales).
    """
    targets: dict[str, Target] = {}
    for name, param in model.named_parameters():
        head, _, leaf = name.rpartition(".")
        module, _, fused = head.rpartition(".")
        owner = model.get_submodule(head)
        experts = isinstance(owner, Projection) and owner.lead
        matrices = [(f"{module}.{e}", m) for e, m in enumerate(param)] if experts else [(module, param)]
        split, stacked = _split(model, head, leaf, matrices[0][1]), model.STACKED.get(fused)
        for prefix, matrix in matrices:
            for i, (source, target) in enumerate(model.tp.pieces(split)):
                # a stacked part is a tensor of its own: its rows start at 0 there
                key, start, rows = ((stacked[i], split.starts[i], split.parts[i][0]) if stacked
                                    else (fused, 0, split.full_size))
                shape = matrix.shape[:split.dim] + (rows,) + matrix.shape[split.dim + 1:]
                index = _along(split.dim, slice(source.start - start, source.stop - start))
                targets.setdefault(_join(prefix, key, leaf), Target(
                    tuple(shape), fp8=param.dtype == FP8, per_row=leaf == "weight_scale")).pieces.append(
                    (index, matrix[_along(split.dim, target)]))
    return targets


def _split(model: DecoderLM, head: str, leaf: str, matrix: torch.Tensor) -> Split:
    """``weight_split`` of parameter ``head.leaf``; an FP8 scale's follows its weight's: per-row scales its rows
    (whole on a row-parallel rank, which holds every output row), block scales its blocks of rows, or of columns on a
    row-parallel rank (every fused part a whole number of blocks; every rank's share too, ``TensorParallel.shard``
    checked it)."""
    if not leaf.startswith("weight_scale"):
        return model.weight_split(f"{head}.{leaf}")
    split = model.weight_split(f"{head}.weight")
    block = model.get_submodule(head).block
    if leaf == "weight_scale" and split.dim != 0:
        return Split(0, ((matrix.shape[0], matrix.shape[0]),))
    size = 1 if leaf == "weight_scale" else block[split.dim]
    if any(full % size for full, _ in split.parts):
        raise ConfigError(f"quantization_config.weight_block_size {list(block)}: {head} is fused from parts of "
                          f"{[full for full, _ in split.parts]} {'rows' if split.dim == 0 else 'columns'}, not whole "
                          f"blocks of {size}; blink cannot stack their scales")
    return Split(split.dim, tuple((full // size, local // size) for full, local in split.parts))


def _along(dim: int, rows: slice) -> tuple[slice, ...]:
    """The index that takes ``rows`` of dimension ``dim`` and all of the dimensions before it."""
    return (slice(None),) * dim + (rows,)


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
    if model.config.quantization is not None:
        check_ignored(model.config.quantization, [n.removesuffix(".weight") for n, t in targets.items() if t.fp8])
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


def _copy_tensor(f, file: Path, name: str, target: Target) -> None:
    stored = f.get_slice(name)
    dtype = stored.get_dtype()
    if target.fp8 and dtype != FP8_DTYPE:
        raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; the checkpoint's quantization_config makes "
                              f"it an FP8 weight ({FP8_DTYPE})")
    if not target.fp8 and dtype not in LOADABLE_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; blink loads F32, F16 and BF16 weights "
                              f"({FP8_DTYPE} ones with an FP8 quantization_config)")
    shape = tuple(stored.get_shape())
    if target.per_row:
        rows = target.shape[0]
        if shape not in ((), (1,), (rows,), (rows, 1)):
            raise CheckpointError(f"{file}: tensor {name} has shape {shape}; a per-tensor scale has shape () or (1,), "
                                  f"a per-channel one ({rows},) or ({rows}, 1)")
        scales = f.get_tensor(name).reshape(-1)
        with torch.no_grad():
            for index, view in target.pieces:  # a per-tensor scale is broadcast over the piece's rows
                view.copy_(scales if scales.numel() == 1 else scales[index])
        return
    if shape != target.shape:
        raise CheckpointError(f"{file}: tensor {name} has shape {shape}, the config implies {target.shape}")
    with torch.no_grad():
        for index, view in target.pieces:
            # A whole tensor goes by get_tensor (on CUDA: through pinned memory); a slice is cut from the memory map
            # on the host, reading only its bytes, then copied to the device.
            view.copy_(f.get_tensor(name) if tuple(view.shape) == shape else stored[index])
