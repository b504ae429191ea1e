"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a model.

Role: read the config, pick the family from the registry, stream tensors out of one file or a
sharded `model.safetensors.index.json`, cast to the requested dtype, and fail with a clear
`ModelLoadError` on missing files, missing or unexpected tensors and wrong shapes. Quantized weights:
a checkpoint stored quantized (`prequantized`) gets `QuantizedLinear`s where its tensors say so,
filled with its codes as stored; `quantization=` quantizes a float checkpoint's language model once
its weights are in (`quantization`).
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
from mmserve.models.prequantized import CheckpointQuantization, read_quantization
from mmserve.models.quantization import QUANTIZATION_METHODS, QuantizedLinear, quantize_language_model
from mmserve.models.registry import resolve
from mmserve.models.weights import QKV_GATE_UP

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


def iter_tensors(files: list[Path], dtype: torch.dtype,
                 stored: CheckpointQuantization | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, floating ones cast to `dtype`; a quantized checkpoint's quantization tensors turned
    into `QuantizedLinear`'s (codes as stored, scales in float32)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                converted = stored.convert(name, tensor) if stored is not None else [(name, tensor, False)]
                for ours, value, keep in converted:
                    yield ours, value.to(dtype) if value.is_floating_point() and not keep else value


def _stacked_name(name: str) -> tuple[str, int | None, int]:
    """Our parameter name -> (its stacked name, shard, shards of that stack) (None, 1: not stacked)."""
    for s in QKV_GATE_UP:
        if s.hf_fragment in name:
            count = 1 + max(t.shard for t in QKV_GATE_UP if t.fragment == s.fragment)
            return name.replace(s.hf_fragment, s.fragment), s.shard, count
    return name, None, 1


def install_quantized_linears(model: torch.nn.Module, stored: CheckpointQuantization, files: list[Path],
                              dtype: torch.dtype) -> int:
    """Replace each `nn.Linear` whose checkpoint tensors are stored quantized by an empty `QuantizedLinear`
    of the checkpoint's format (filled by the load that follows). Returns how many were replaced."""
    shards: dict[str, set[int | None]] = {}
    counts: dict[str, int] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                dtype_name = f.get_slice(hf_name).get_dtype()
                prefix = stored.marks_quantized(hf_name, torch.int8 if dtype_name == "I8" else torch.int32)
                if prefix is None:
                    continue
                renamed = model._rename(prefix + ".weight", torch.empty(0))
                if renamed is None:
                    continue
                path, shard, count = _stacked_name(renamed[0])
                path = path.removesuffix(".weight")
                if not path.startswith("language_model."):
                    raise ModelLoadError(f"{hf_name}: a quantized layer outside the language model; mmserve "
                                         "runs the vision tower in the model dtype")
                shards.setdefault(path, set()).add(shard)
                counts[path] = count
    for path, found in shards.items():
        if len(found) != counts[path]:
            raise ModelLoadError(f"{path}: only some of its stacked projections are stored quantized")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        if not isinstance(linear, torch.nn.Linear):
            raise ModelLoadError(f"{path}: stored quantized but is not a linear layer")
        setattr(parent, attr, QuantizedLinear(linear.in_features, linear.out_features,
                                              stored.weight_format(linear.in_features), linear.bias is not None,
                                              dtype))
    return len(shards)


def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """The method a checkpoint is stored quantized with, or None (raises for one mmserve does not run)."""
    stored = read_quantization(read_config(model_dir))
    return None if stored is None else stored.method


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", quantization: str | None = None) -> torch.nn.Module:
    """Build the model for `model_dir` with every weight loaded; eval mode, no grad. `quantization`
    (one of QUANTIZATION_METHODS) quantizes a float checkpoint's language model at load."""
    raw = read_config(model_dir)
    family = resolve(raw)
    config = family.parse_config(raw)
    torch_dtype = parse_dtype(dtype)
    stored = read_quantization(raw)
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATION_METHODS)}")
    if stored is not None and quantization is not None:
        raise ModelLoadError(f"{model_dir} is stored quantized ({stored.method}); leave quantization unset to run "
                             f"it as stored, not {quantization!r}")
    model = family.model_class(config)
    # only parameters take the dtype: buffers (rotary tables) stay as built in float32, as the reference
    # computes its angles; a round trip through bfloat16 would change them
    for param in model.parameters():
        param.data = param.data.to(torch_dtype)
    files = safetensors_files(model_dir)
    if stored is not None:
        install_quantized_linears(model, stored, files, torch_dtype)
    try:
        loaded, unexpected = model.load_weights(iter_tensors(files, torch_dtype, stored))
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    if unexpected:
        raise ModelLoadError(f"{model_dir}: checkpoint has {len(unexpected)} unexpected tensors, "
                             f"e.g. {unexpected[:5]}")
    if quantization is not None:
        quantize_language_model(model, quantization)
    model.eval().requires_grad_(False)
    return model.to(device)
