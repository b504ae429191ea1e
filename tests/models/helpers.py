"""Test helpers: load mmserve's model/processor for a checkpoint and compute full-prompt logits."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.media import MediaLimits
from mmserve.models.generation import prefill_inputs, prefill_metadata, prompt_positions
from mmserve.models.layers.attention import ContiguousKVCache
from mmserve.models.loader import load_model, read_config
from mmserve.models.registry import resolve
from mmserve.models.spec import FamilySpec


def load_processor(model_dir):
    """The family's processor for a checkpoint, without loading weights."""
    family = resolve(read_config(model_dir))
    return family.processor_class(model_dir, family.parse_config(read_config(model_dir)), MediaLimits())


def load_family(model_dir, dtype: str = "float32"):
    """(model, processor, spec) for a checkpoint, as the engine builds them."""
    family = resolve(read_config(model_dir))
    model = load_model(model_dir, dtype)
    processor = family.processor_class(model_dir, model.config, MediaLimits())
    return model, processor, family.build_spec(model.config, processor, MediaLimits())


def load_pair(model_dir):
    model, processor, _ = load_family(model_dir)
    return model, processor


@torch.inference_mode()
def full_logits(model, prompt: ProcessedPrompt, spec: FamilySpec) -> torch.Tensor:
    """(num_tokens, vocab) logits of a whole prompt in one prefill."""
    layout = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    n = prompt.num_tokens
    dtype = next(model.parameters()).dtype
    cpu = torch.device("cpu")
    cache = ContiguousKVCache(layout[0], 1, n, layout[1], layout[2], dtype)
    embeds, extra = prefill_inputs(model, prompt, cpu)
    hidden = model(embeds, prompt_positions(prompt, 0, n, cpu), cache, prefill_metadata(prompt, spec), extra)
    return model.compute_logits(hidden)


def random_image(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    # smooth gradient plus noise: resampling differences would show
    yy, xx = np.mgrid[0:height, 0:width]
    base = ((xx * 255 // max(width - 1, 1)) + (yy * 255 // max(height - 1, 1))) // 2
    arr = (base[..., None] + rng.integers(-40, 40, (height, width, channels))).clip(0, 255).astype(np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image_part(img):
    return {"type": "image_pil", "image_pil": img}


def text_part(text):
    return {"type": "text", "text": text}


REFERENCE_IMAGE_PART = {"type": "image"}
REFERENCE_VIDEO_PART = {"type": "video"}
