"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a model.

Role: read the config, pick the family from the registry, stream tensors out of one file or a
sharded `model.safetensors.index.json`, cast to the requested dtype, and fail with a clear
`ModelLoadError` on missing files, missing or unexpected tensors and wrong shapes.
What it does not know: tokenizers and processors (see the family's processor).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import token_ids
from mmserve.models.registry import resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError as exc:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16") from exc


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"no config.json in {model_dir}")
    return json.loads(path.read_text())


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json (an int or a list), if the file exists."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    return token_ids(json.loads(path.read_text()).get("eos_token_id"))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({root / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    return files


def iter_tensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model for `model_dir` with every weight loaded; eval mode, no grad."""
    raw = read_config(model_dir)
    family = resolve(raw)
    config = family.parse_config(raw)
    torch_dtype = parse_dtype(dtype)
    model = family.model_class(config)
    # only parameters take the dtype: buffers (rotary tables) stay as built in float32, as the reference
    # computes its angles; a round trip through bfloat16 would change them
    for param in model.parameters():
        param.data = param.data.to(torch_dtype)
    try:
        loaded, unexpected = model.load_weights(iter_tensors(safetensors_files(model_dir), torch_dtype))
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    if unexpected:
        raise ModelLoadError(f"{model_dir}: checkpoint has {len(unexpected)} unexpected tensors, "
                             f"e.g. {unexpected[:5]}")
    model.eval().requires_grad_(False)
    return model.to(device)
