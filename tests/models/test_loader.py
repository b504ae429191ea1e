"""Loading checkpoints: dtypes, sharded files, and clear errors for broken checkpoints."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve import ModelLoadError
from mmserve.models.generation import generate
from mmserve.models.loader import load_model
from mmserve.models.registry import supported_architectures
from tests.models.helpers import full_logits, image_part, load_family, random_image, text_part, user


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "ckpt")
    _edit_weights(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors.*layers\.0\.self_attn\.qkv_proj\.weight#1"):
        load_model(d)


def test_unexpected_tensor_is_named(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "ckpt")
    _edit_weights(d, lambda t: t.__setitem__("model.layers.0.surprise.weight", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.0\.surprise\.weight"):
        load_model(d)


def test_wrong_shape_is_named(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "ckpt")
    _edit_weights(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(3,\).*expected \(64,\)"):
        load_model(d)


def test_unsupported_architecture_lists_supported(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlavaForConditionalGeneration"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="LlavaForConditionalGeneration.*" + supported_architectures()[0]):
        load_model(d)


def test_missing_files(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads_identically(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "ckpt")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(model_dir), load_model(d)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_load_and_stay_close(model_dir, dtype):
    img = random_image(np.random.default_rng(5), 64, 64)
    reference, proc, spec = load_family(model_dir)
    chat = proc.render_chat(user(image_part(img), text_part("Describe.")))
    prompt = proc.process(chat.prompt, images=chat.images)
    ref = full_logits(reference, prompt, spec)
    model = load_model(model_dir, dtype)
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    low = full_logits(model, prompt, spec).float()
    assert low.shape == ref.shape
    assert (low - ref).abs().max().item() < 0.25 * ref.abs().max().item()
    assert len(list(generate(model, spec, prompt, 4, min_new_tokens=4))) == 4
