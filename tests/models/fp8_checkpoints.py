"""Small FP8 checkpoints written the way quantizers write them (llm-compressor, DeepSeek/Qwen FP8 releases), from a
tiny HF model: e4m3 projections with their scales and a config.json with the ``quantization_config``. Each writer
also returns the dequantized weights, the reference the loaded model must compute with."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
BLOCK = [32, 32]  # the tiny models' q (64), k/v (32), MLP (96) and expert (32) widths are whole blocks

# variant → (quantization_config, how scales are laid out)
VARIANTS = {
    "fp8-tensor": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK},
    "ct-tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {
                      "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
                      "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                  "symmetric": True}}}},
    "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "ignore": ["lm_head", "re:.*mlp.gate$"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                       "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True}}}},
}


def is_projection(name: str) -> bool:
    """The tensors quantizers turn to FP8: every ``*_proj.weight`` (attention, MLP, experts); not the embeddings, the
    LM head, norms or the MoE router (``mlp.gate.weight``)."""
    return name.endswith("_proj.weight")


def quantize(w: torch.Tensor, variant: str, block=BLOCK) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(e4m3 weight, its scale tensors by leaf name, the dequantized weight in float32)."""
    w = w.float()
    if variant == "fp8-block":
        bn, bk = block
        tiles = w.unflatten(1, (-1, bk)).unflatten(0, (-1, bn))  # [N/bn, bn, K/bk, bk]
        scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q, {"weight_scale_inv": scale}, q.float() * full
    if variant == "ct-channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX  # [N, 1], stored in bf16 as llm-compressor does
        scale = scale.bfloat16()
        q = (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q, {"weight_scale": scale}, q.float() * scale.float()
    scale = w.abs().amax() / E4M3_MAX
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    stored = scale.reshape(1) if variant == "ct-tensor" else scale  # compressed-tensors: [1]; fp8: a scalar
    extra = {"input_scale": torch.tensor(0.05)} if variant == "fp8-tensor" else {}  # static scheme: not read
    return q, {"weight_scale": stored, **extra}, q.float() * scale


def write_fp8_checkpoint(hf_model, path, variant: str, block=BLOCK):
    """Save ``hf_model`` to ``path`` as the FP8 checkpoint ``variant`` (``fp8-block``: of ``block``); returns the
    reference: the same model with every projection replaced by its dequantized weights (float32, loaded by
    transformers)."""
    from transformers import AutoModelForCausalLM

    reference = path.parent / f"{path.name}-dequantized"
    hf_model.save_pretrained(reference)
    stored = load_file(reference / "model.safetensors")  # the checkpoint names (per-expert tensors)
    tensors, dequantized = {}, {}
    for name, w in stored.items():
        if is_projection(name):
            q, scales, dequantized[name] = quantize(w, variant, block)
            tensors[name] = q
            tensors.update({f"{name.removesuffix('weight')}{leaf}": s for leaf, s in scales.items()})
        else:
            tensors[name] = dequantized[name] = w
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    config["quantization_config"] = {**VARIANTS[variant], **({"weight_block_size": list(block)}
                                                              if variant == "fp8-block" else {})}
    (path / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
