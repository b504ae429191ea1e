"""Export an mmserve Qwen2-VL model's weights as a standard Hugging Face checkpoint file.

Role: the inverse of `Qwen2VLForConditionalGeneration.load_weights`: unstack the fused
`qkv_proj` ([q | k | v] rows) and `gate_up_proj` ([gate | up] rows), rename `language_model.*`
to the hub's `model.*` / `lm_head.*`, reshape the flattened patch embedding back to the Conv3d
weight (embed, C, T, P, P), and write `model.safetensors`. What it does not know: config.json,
tokenizers and processors (the caller writes those).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration


def _hub_name(name: str) -> str:
    if name.startswith("language_model.lm_head."):
        return "lm_head." + name[len("language_model.lm_head."):]
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    return name


def _split_stacked(name: str, tensor: torch.Tensor, model: Qwen2VLForConditionalGeneration) -> dict[str, torch.Tensor]:
    if ".qkv_proj." in name:
        t = model.config.text
        sizes = [t.num_attention_heads * t.head_dim] + [t.num_key_value_heads * t.head_dim] * 2
        parts = tensor.split(sizes, dim=0)
        return {name.replace(".qkv_proj.", f".{p}_proj."): x for p, x in zip("qkv", parts)}
    if ".gate_up_proj." in name:
        gate, up = tensor.chunk(2, dim=0)
        return {name.replace(".gate_up_proj.", ".gate_proj."): gate, name.replace(".gate_up_proj.", ".up_proj."): up}
    return {name: tensor}


def hf_state_dict(model: Qwen2VLForConditionalGeneration) -> dict[str, torch.Tensor]:
    """Hub-named, hub-shaped, contiguous CPU copies of every parameter (lm_head omitted when tied)."""
    vision = model.config.vision
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = param.detach().to("cpu")
        if name == "visual.patch_embed.weight":
            shape = (tensor.shape[0], vision.in_channels, vision.temporal_patch_size,
                     vision.patch_size, vision.patch_size)
            out["visual.patch_embed.proj.weight"] = tensor.reshape(shape)
            continue
        for piece, value in _split_stacked(name, tensor, model).items():
            out[_hub_name(piece)] = value
    return {k: v.contiguous().clone() for k, v in sorted(out.items())}


def save_weights(model: Qwen2VLForConditionalGeneration, out_dir: str | Path,
                 dtype: torch.dtype | None = None) -> Path:
    """Write `model.safetensors` (optionally cast to `dtype`) into out_dir; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors writes 0600; a shipped asset must be readable by everyone
    return path
