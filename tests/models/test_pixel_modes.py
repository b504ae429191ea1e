"""Every Pillow mode and every kind of image source gives, per family, the pixels transformers gives: a PIL
image against the family's PIL image processor (transparency composited onto white), an encoded file or data
URI against transformers' `load_image` then that processor (EXIF orientation applied, alpha dropped), an RGBA
array against the processor's array path — bit for bit, with the same patch grid or tiles. A multi-turn chat
with a transparent picture then answers with transformers' greedy tokens."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.image_utils import load_image as hf_load_image

from mmserve import LLM, SamplingParams
from testkit.families import FAMILIES
from tests.models.helpers import load_processor

# modes an image may come in (as a PIL object); "P+t": a palette with a transparent entry
PIL_MODES = ("RGB", "RGBA", "LA", "P", "P+t", "PA", "CMYK", "L", "1", "I;16", "I", "F", "YCbCr", "RGBX")
# what PNG keeps of them (an encoded file)
PNG_MODES = ("RGB", "RGBA", "LA", "P", "P+t", "L", "1", "I;16")


def _image(mode: str, width: int, height: int, seed: int, alpha: str) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    if alpha == "gradient":
        rgba[..., 3] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    elif alpha == "binary":
        rgba[..., 3] = (rng.random((height, width)) > 0.5) * 255
    image = Image.fromarray(rgba, "RGBA")
    if mode in ("RGBA", "RGBa"):
        return image if mode == "RGBA" else image.convert("RGBa")
    if mode in ("LA", "PA"):
        return image.convert(mode)
    if mode in ("P", "P+t"):
        palette = image.convert("RGB").convert("P")
        if mode == "P+t":
            palette.info["transparency"] = int(np.asarray(palette)[0, 0])
        return palette
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width)).astype(np.uint16))
    if mode == "I":
        return Image.fromarray(rng.integers(-300, 600, (height, width)).astype(np.int32))
    if mode == "F":
        return Image.fromarray(rng.uniform(-20, 300, (height, width)).astype(np.float32))
    rgb = image.convert("RGB")
    return rgb if mode == "RGB" else rgb.convert("L").convert(mode) if mode in ("L", "1") else rgb.convert(mode)


def _data_uri(image: Image.Image, fmt: str = "PNG", **save: object) -> str:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


_REFERENCES: dict = {}


def _reference_processor(model_dir):
    """The family's transformers image processor (its PIL backend), called as the family's processor calls it."""
    if model_dir not in _REFERENCES:
        pre = model_dir / "preprocessor_config.json"
        if pre.is_file():
            name = json.loads(pre.read_text())["image_processor_type"]
            name = name.removesuffix("Fast").removesuffix("Pil")
            image_processor = getattr(transformers, f"{name}Pil").from_pretrained(model_dir)
        else:  # the hub's newer layout (Gemma 4): the settings in processor_config.json's image_processor
            section = dict(json.loads((model_dir / "processor_config.json").read_text())["image_processor"])
            name = section.pop("image_processor_type").removesuffix("Fast").removesuffix("Pil")
            image_processor = getattr(transformers, f"{name}Pil")(**section)
        config = json.loads((model_dir / "config.json").read_text())
        extra = {}
        if "Pixtral" in name:  # Mistral 3's processor resizes to whole merged patches
            extra["patch_size"] = config["vision_config"]["patch_size"] * config.get("spatial_merge_size", 2)
        _REFERENCES[model_dir] = lambda images, return_tensors: image_processor(
            images=images, return_tensors=return_tensors, **extra)
    return _REFERENCES[model_dir]


def _ours(processor, source):
    chat = processor.render_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}])
    return processor.process(chat.prompt, images=[source]).items


def _assert_same_pixels(family: str, items, ref: dict) -> None:
    """Our one image's payload against transformers' outputs for it: the same float32 values and layout."""
    (item,) = [i for i in items if not i.part] or items[:1]
    payload = item.payload
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert tuple(payload.grid_thw) == tuple(ref["image_grid_thw"][0].tolist())
        got, want = payload.pixel_values, ref["pixel_values"]
    elif family == "mistral3":
        got = payload.pixel_values()
        assert tuple(got.shape[1:]) == tuple(ref["image_sizes"][0].tolist())
        want = ref["pixel_values"][0][:, :got.shape[1], :got.shape[2]]
    elif family == "llava_onevision":
        got = payload.pixel_values
        want = ref["pixel_values"][0]
        assert not want[len(got):].any()  # the batch's padding tiles
        want = want[:len(got)]
    elif family == "mllama":  # its tiles, padded to the tower's tiles as transformers pads them
        got, want = payload.pixel_values, ref["pixel_values"][0, 0]
        assert payload.aspect_ratio_id == int(ref["aspect_ratio_ids"][0, 0])
        assert payload.num_tiles == int(ref["aspect_ratio_mask"][0, 0].sum())
    elif family == "gemma4":  # its real patches; transformers pads to max_patches with positions -1
        real = (ref["image_position_ids"][0] != -1).all(-1)
        got, want = payload.pixel_values, ref["pixel_values"][0][real]
        assert np.array_equal(payload.position_ids, ref["image_position_ids"][0][real])
    else:  # gemma3: the whole image, then any crops
        got, want = payload.pixel_values, ref["pixel_values"]
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    assert np.array_equal(got, want), f"max difference {np.abs(got - want).max()}"


SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SIZES = st.tuples(st.integers(8, 260), st.integers(8, 200))
ALPHA = st.sampled_from(["gradient", "binary", "random"])


@SETTINGS
@given(mode=st.sampled_from(PIL_MODES), size=SIZES, seed=st.integers(0, 2**16), alpha=ALPHA)
def test_pil_images_in_every_mode(served_family, served_model_dir, mode, size, seed, alpha):
    image = _image(mode, *size, seed, alpha)
    ref = _reference_processor(served_model_dir)(images=[image], return_tensors="np")
    _assert_same_pixels(served_family, _ours(load_processor(served_model_dir), image), ref)


@SETTINGS
@given(mode=st.sampled_from(PNG_MODES), size=SIZES, seed=st.integers(0, 2**16), alpha=ALPHA)
def test_encoded_images_as_transformers_loads_them(served_family, served_model_dir, mode, size, seed, alpha):
    uri = _data_uri(_image(mode, *size, seed, alpha))
    ref = _reference_processor(served_model_dir)(images=[hf_load_image(uri)], return_tensors="np")
    _assert_same_pixels(served_family, _ours(load_processor(served_model_dir), uri), ref)


def _special_files() -> dict[str, str]:
    """An EXIF-rotated JPEG, the first frame of an animated GIF (with a transparent index) and of an
    animated WebP."""
    base = _image("RGBA", 90, 60, 7, "gradient")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    frames = [_image("RGBA", 90, 60, s, "binary") for s in range(3)]
    gif = [f.convert("RGB").convert("P") for f in frames]
    return {
        "jpeg_exif_rotated": _data_uri(base.convert("RGB"), "JPEG", exif=exif.tobytes(), quality=90),
        "gif_animated": _data_uri(gif[0], "GIF", save_all=True, append_images=gif[1:], transparency=0, duration=50),
        "webp_animated": _data_uri(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True),
    }


@pytest.mark.parametrize("kind", ["jpeg_exif_rotated", "gif_animated", "webp_animated"])
def test_rotated_and_animated_files(served_family, served_model_dir, kind):
    uri = _special_files()[kind]
    ref = _reference_processor(served_model_dir)(images=[hf_load_image(uri)], return_tensors="np")
    items = _ours(load_processor(served_model_dir), uri)
    _assert_same_pixels(served_family, items, ref)


def test_rgba_arrays_as_transformers_composites_them(served_family, served_model_dir):
    array = np.asarray(_image("RGBA", 70, 45, 3, "gradient"))
    ref = _reference_processor(served_model_dir)(images=[array], return_tensors="np")
    _assert_same_pixels(served_family, _ours(load_processor(served_model_dir), array), ref)


# ---- greedy tokens of a multi-turn chat with a transparent picture ------------------------------------
NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl", "gemma3"])
def test_a_multi_turn_chat_with_a_transparent_picture_answers_like_transformers(all_checkpoints, family):
    """The picture as a client sends it (a PNG data URI); transformers loads it with `load_image` and its
    processor makes the pixels, which go into its model with the chat's prompt ids."""
    model_dir = all_checkpoints[family]
    uri = _data_uri(_image("RGBA", 120, 90, 11, "gradient"))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "What is in the picture?"}]},
                {"role": "assistant", "content": "Some coloured noise."},
                {"role": "user", "content": [{"type": "text", "text": "And its colours?"}]}]
    llm = LLM(str(model_dir))
    got = list(llm.chat([messages], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    processor = load_processor(model_dir)
    chat = processor.render_chat(messages)
    prompt = processor.process(chat.prompt, images=chat.images)
    fixture = FAMILIES[family]
    pil_messages = [dict(m, content=[{"type": "image_pil", "image_pil": hf_load_image(uri)} if p.get("type") ==
                                     "image_url" else p for p in m["content"]]) if isinstance(m["content"], list)
                    else m for m in messages]
    inputs = fixture.reference_kwargs(model_dir, pil_messages, prompt)
    ref = _reference_processor(model_dir)(images=[hf_load_image(uri)], return_tensors="pt")
    inputs["pixel_values"] = ref["pixel_values"]  # transformers' own pixels, not ours
    model = fixture.reference_class().from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
    assert got == out[0, inputs["input_ids"].shape[1]:].tolist()
    llm.check_integrity()
