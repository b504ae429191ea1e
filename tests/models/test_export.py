"""Exporting an mmserve Qwen2-VL model to a hub checkpoint round-trips exactly, and transformers loads it."""

from __future__ import annotations

import shutil

import pytest
import torch

from mmserve.models.loader import load_model, read_config
from mmserve.models.qwen2_vl.config import parse_config
from mmserve.models.qwen2_vl.export import hf_state_dict, save_weights
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration


def _random_model(model_dir, seed: int) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration(parse_config(read_config(model_dir)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def _export(model, model_dir, out):
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_weights(model, out)
    return out


def test_round_trip_is_exact(model_dir, tmp_path):
    model = _random_model(model_dir, seed=3)
    loaded = load_model(_export(model, model_dir, tmp_path / "exported"))
    ours, back = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert ours.keys() == back.keys()
    for name, param in ours.items():
        assert torch.equal(param, back[name]), name


def test_names_and_shapes_match_transformers(model_dir):
    from safetensors import safe_open

    reference = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            reference[name] = tuple(f.get_slice(name).get_shape())
    exported = {k: tuple(v.shape) for k, v in hf_state_dict(_random_model(model_dir, seed=4)).items()}
    assert exported == reference


def test_transformers_loads_export(model_dir, family, tmp_path):
    import transformers

    model = _random_model(model_dir, seed=5)
    out = _export(model, model_dir, tmp_path / "exported")
    cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}[family]
    hf, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf_params = {k: v for k, v in hf.state_dict().items()}
    q_size = model.config.text.num_attention_heads * model.config.text.head_dim
    qkv = model.language_model.layers[0].self_attn.qkv_proj.weight
    q_hf = next(v for k, v in hf_params.items() if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert torch.equal(q_hf, qkv[:q_size])
    patch = next(v for k, v in hf_params.items() if k.endswith("patch_embed.proj.weight"))
    assert torch.equal(patch.reshape(patch.shape[0], -1), model.visual.patch_embed.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_export_casts(model_dir, tmp_path, dtype):
    from safetensors.torch import load_file

    path = save_weights(_random_model(model_dir, seed=6), tmp_path / "w", dtype=dtype)
    assert {t.dtype for t in load_file(str(path)).values()} == {dtype}
