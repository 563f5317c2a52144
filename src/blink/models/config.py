"""HF ``config.json`` → ``ModelConfig``: the handful of numbers a blink model step is built from.

Both spellings of the RoPE settings are read: the older top-level ``rope_theta`` / ``rope_scaling`` /
``partial_rotary_factor`` and transformers 5's ``rope_parameters`` dict; likewise ``num_experts`` and transformers 5's
``num_local_experts``. Anything the model step does not implement (an unknown architecture, a RoPE scaling type,
biases, an activation other than SiLU, per-layer sliding windows, a ``quantization_config`` other than FP8:
``quantization.py``) is refused here, by field name, so a checkpoint never loads into a model that would compute
something else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from blink.errors import ConfigError

from .quantization import Fp8Config, parse_quantization

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0 (got {self.factor})")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError("rope_scaling needs 0 < low_freq_factor < high_freq_factor "
                              f"(got {self.low_freq_factor}, {self.high_freq_factor})")
        if self.original_max_position_embeddings < 1:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be >= 1")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only model. ``sliding_window == 0`` means full attention.

    Mixture of experts (``MOE_ARCHITECTURES`` only; ``num_experts == 0`` elsewhere): layer ``i`` routes each token to
    ``num_experts_per_tok`` of ``num_experts`` SiLU MLPs of width ``moe_intermediate_size`` unless ``i`` is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, where it has a dense MLP of ``intermediate_size``
    (HF's rule). ``norm_topk_prob`` renormalises the chosen experts' softmax weights to sum to 1.

    Invariants: ``num_heads % num_kv_heads == 0``; ``rotary_dim`` is even and ``<= head_dim``;
    ``1 <= num_experts_per_tok <= num_experts`` for a MoE architecture.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0
    dtype: str = "bfloat16"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    quantization: Fp8Config | None = None

    def __post_init__(self):
        _check_architecture(self.architecture)
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rotary_dim", "max_position_embeddings"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{f} must be a positive int (got {value!r})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("rms_norm_eps and rope_theta must be > 0")
        if self.sliding_window < 0:
            raise ConfigError(f"sliding_window must be >= 0 (got {self.sliding_window})")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
        if self.architecture in MOE_ARCHITECTURES:
            self._check_experts()
        elif self.num_experts:
            raise ConfigError(f"num_experts={self.num_experts}: {self.architecture} has no experts "
                              f"(mixture of experts: {', '.join(MOE_ARCHITECTURES)})")

    def _check_experts(self):
        for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{f} must be a positive int for {self.architecture} (got {value!r})")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                              f"({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {bad} are not layers of a {self.num_layers}-layer model")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has routed experts (HF Qwen3-MoE's rule) rather than a dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config dict; ``source`` names it in errors."""
        try:
            return cls(**_hf_fields(hf))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except KeyError as e:
            raise ConfigError(f"{source}: missing field {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """``path`` is a config.json or a directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file (a model directory needs a config.json)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(hf, str(path))

    def to_hf(self) -> dict:
        """The HF config.json this config was read from, up to fields blink ignores."""
        hf = {"architectures": [self.architecture], "model_type": _MODEL_TYPES[self.architecture],
              "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
              "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
              "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
              "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
              "partial_rotary_factor": self.rotary_dim / self.head_dim,
              "max_position_embeddings": self.max_position_embeddings,
              "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": self.dtype,
              "sliding_window": self.sliding_window or None}
        if self.num_experts:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        if self.rope_scaling:
            hf["rope_scaling"] = {"rope_type": "llama3", **{f.name: getattr(self.rope_scaling, f.name)
                                                             for f in fields(RopeScaling)}}
        if self.quantization:
            hf["quantization_config"] = self.quantization.to_hf()
        return hf


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                "Phi3ForCausalLM": "phi3"}


def _check_architecture(arch: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {arch!r} is not supported; blink serves {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _hf_fields(hf: dict) -> dict:
    archs = hf.get("architectures") or [hf.get("model_type", "<none>")]
    arch = _check_architecture(archs[0])
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}=true is not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    rope = hf.get("rope_parameters") or {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    window = 0 if arch.startswith("Qwen3") else hf.get("sliding_window") or 0
    return dict(
        architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rotary_dim=int(head_dim * partial), max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(hf.get("rope_scaling") or rope), sliding_window=window,
        dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
        quantization=parse_quantization(hf.get("quantization_config")),
        **(_moe_fields(hf) if arch in MOE_ARCHITECTURES else {}))


def _moe_fields(hf: dict) -> dict:
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise KeyError("num_experts")
    return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob")),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def _rope_scaling(rope: dict) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling.rope_type {kind!r} is not supported (only 'default' and 'llama3')")
    return RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                       int(rope["original_max_position_embeddings"]))
