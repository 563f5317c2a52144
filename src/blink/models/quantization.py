"""FP8 weights: what a checkpoint's ``quantization_config`` asks for (no torch: the agent's install reads model
configs too); the arithmetic of e4m3 with float32 scales is ``e4m3.py``.

Two layouts of the weights of every attention and MLP projection (experts included; embeddings, the LM head, norms
and the MoE router stay in the model dtype), as vLLM reads them:

- per output row (``Fp8Config.weight_block_size is None``): ``weight`` e4m3 ``[N, K]`` and ``weight_scale`` float32
  ``[N]``, ``weight = e4m3 * weight_scale[:, None]``. Per-tensor checkpoints (``quant_method: fp8`` without blocks,
  ``compressed-tensors`` strategy ``tensor``: one scale per checkpoint tensor) fill the rows of their tensor with it;
  per-channel ones (``compressed-tensors`` strategy ``channel``: ``[N, 1]``) give each row its own; ``--quantization
  fp8`` computes it at load (``e4m3.quantize_rows``). Fused q/k/v then keep every part's own scale, without
  requantizing.
- per block (``weight_block_size = (bn, bk)``, ``quant_method: fp8`` with ``weight_block_size``, DeepSeek-V3 / Qwen3
  FP8): ``weight_scale_inv`` float32 ``[ceil(N / bn), ceil(K / bk)]`` (despite its name, a multiplier).

Activations are quantized per token inside the step (``kernels.quantize``: one scale per row, or per row and
``bk`` columns with block weights), whatever a checkpoint's activation scheme: a static ``input_scale`` is not read
(per-token scales are at least as fine). Anything else (``fmt: e5m2``, other methods, integer or grouped weights,
asymmetric scales, projections left unquantized by ``ignored_layers`` / ``ignore``) is refused by field name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from blink.errors import ConfigError

SCALED_MM_MULTIPLE = 16  # torch._scaled_mm takes N and K in multiples of 16
QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization / --quantization: quantize bf16 weights at load
METHODS = ("fp8", "compressed-tensors")
FIELD = "quantization_config"


@dataclass(frozen=True)
class Fp8Config:
    """FP8 e4m3 projections with float32 scales per output row, or per ``weight_block_size`` (rows, columns) block;
    ``ignored`` are the checkpoint's exemptions (module names, or ``re:`` patterns), which must not name a projection
    blink quantizes (``check_ignored``)."""

    weight_block_size: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()

    def __post_init__(self):
        block = self.weight_block_size
        if block is not None and (len(block) != 2 or any(type(b) is not int or b < 16 or b & (b - 1)
                                                         for b in block)):
            raise ConfigError(f"{FIELD}.weight_block_size {list(block)} is not supported: blink's block-scale kernel "
                              "takes two powers of two >= 16 (checkpoints use [128, 128])")

    @property
    def scale_name(self) -> str:
        """The checkpoint's (and the parameter's) name of the scales beside ``weight``."""
        return "weight_scale" if self.weight_block_size is None else "weight_scale_inv"

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        if self.weight_block_size is None:
            return (rows,)
        bn, bk = self.weight_block_size
        return (-(-rows // bn), -(-cols // bk))

    def to_hf(self) -> dict:
        hf = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "ignored_layers": list(self.ignored)}
        if self.weight_block_size is not None:
            hf["weight_block_size"] = list(self.weight_block_size)
        return hf


def parse_quantization(hf: dict | None) -> Fp8Config | None:
    """``quantization_config`` of an HF config.json → ``Fp8Config`` (None when absent); ``ConfigError`` naming the
    field of anything blink does not compute as the checkpoint asks."""
    if not hf:
        return None
    method = hf.get("quant_method")
    if method == "fp8":
        return _fp8(hf)
    if method == "compressed-tensors":
        return _compressed_tensors(hf)
    raise ConfigError(f"{FIELD}.quant_method {method!r} is not supported: blink loads FP8 checkpoints "
                      f"({' or '.join(map(repr, METHODS))}), or bf16 ones with --quantization fp8")


def _fp8(hf: dict) -> Fp8Config:
    if hf.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{FIELD}.fmt {hf['fmt']!r} is not supported (only 'e4m3')")
    if hf.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ConfigError(f"{FIELD}.activation_scheme {hf['activation_scheme']!r} is not supported "
                          "('dynamic' or 'static')")
    block = hf.get("weight_block_size")
    ignored = (hf.get("ignored_layers") or []) + (hf.get("modules_to_not_convert") or [])
    return Fp8Config(tuple(block) if block is not None else None, tuple(ignored))


def _compressed_tensors(hf: dict) -> Fp8Config:
    if hf.get("format") not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"{FIELD}.format {hf.get('format')!r} is not supported: blink loads compressed-tensors "
                          "FP8 ('float-quantized')")
    groups = hf.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{FIELD}.config_groups is missing: nothing says how the weights are quantized")
    for name, group in groups.items():
        where = f"{FIELD}.config_groups.{name}"
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ConfigError(f"{where}.weights: {weights.get('num_bits')}-bit {weights.get('type')} weights are "
                              "not supported (only 8-bit float: FP8 e4m3)")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ConfigError(f"{where}.weights.strategy {weights.get('strategy')!r} is not supported for "
                              "compressed-tensors FP8 ('tensor' or 'channel')")
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise ConfigError(f"{where}.weights: only symmetric, static weight scales are supported")
        acts = group.get("input_activations")
        if acts and (acts.get("type"), acts.get("num_bits")) != ("float", 8):
            raise ConfigError(f"{where}.input_activations: {acts.get('num_bits')}-bit {acts.get('type')} "
                              "activations are not supported (FP8 activations are quantized per token)")
    return Fp8Config(None, tuple(hf.get("ignore") or ()))


def requested(config, quantization: str | None):
    """``config`` (a ``ModelConfig``) as ``quantization`` asks for it: with per-row FP8 projections for ``"fp8"``
    unless its checkpoint is FP8 already (whose layout wins, as in vLLM)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of {QUANTIZATIONS} or None")
    if quantization is None or config.quantization is not None:
        return config
    return replace(config, quantization=Fp8Config())


def check_ignored(config: Fp8Config, projections: list[str]) -> None:
    """``ConfigError`` when an exemption of the checkpoint names one of ``projections`` (checkpoint module names of
    the projections blink quantizes): blink quantizes all of them or none."""
    for entry in config.ignored:
        pattern = entry[3:] if entry.startswith("re:") else None
        for name in projections:
            if (re.fullmatch(pattern, name) if pattern is not None
                    else name == entry or name.startswith(entry + ".")):
                raise ConfigError(f"{FIELD} ignores {entry!r}, which leaves {name} unquantized: blink quantizes "
                                  "every attention and MLP projection or none")
