"""Draft models for speculative decoding's tests and benchmarks: a checkpoint with its language model's later
layers removed (the same tokenizer, vocabulary, vision tower and head), as the issue's drafters are made."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncated_copy(src: Path, dst: Path, num_layers: int, noise: float = 0.0, seed: int = 0) -> Path:
    """A copy of checkpoint `src` at `dst` keeping the first `num_layers` decoder layers of its language model;
    `noise`: each kept decoder layer's matrices perturbed by that share of their own spread (a drafter that
    agrees with its target only sometimes)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        return dst
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            if path.is_file():
                shutil.copy2(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        old = section.get("num_hidden_layers")
        if old is None:
            continue
        section["num_hidden_layers"] = num_layers
        for key, value in list(section.items()):  # per-layer lists (layer types) follow the count
            if isinstance(value, list) and len(value) == old:
                section[key] = value[:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors, generator = {}, torch.Generator().manual_seed(seed)
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            match = _LAYER.search(name)
            vision = "visual" in name or "vision" in name
            if match is None or vision or int(match.group(1)) < num_layers:
                if noise and match is not None and not vision and tensor.dim() == 2:
                    spread = tensor.float().std()
                    tensor = (tensor.float() + noise * spread * torch.randn(tensor.shape, generator=generator)
                              ).to(tensor.dtype)
                tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
