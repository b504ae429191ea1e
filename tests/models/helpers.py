"""Test helpers: load mmserve's model/processor for a checkpoint and compute full-prompt logits."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mmserve.inputs.items import ProcessedPrompt
from mmserve.models.generation import prefill_embeds
from mmserve.models.layers.attention import AttentionMetadata, ContiguousKVCache
from mmserve.models.loader import load_model, read_config
from mmserve.models.qwen2_vl.config import parse_config
from mmserve.models.qwen2_vl.processor import Qwen2VLProcessor


def load_processor(model_dir) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(model_dir, parse_config(read_config(model_dir)))


def load_pair(model_dir):
    model = load_model(model_dir)
    return model, Qwen2VLProcessor(model_dir, model.config)


@torch.inference_mode()
def full_logits(model, prompt: ProcessedPrompt) -> torch.Tensor:
    """(num_tokens, vocab) logits of a whole prompt in one prefill."""
    t = model.config.text
    n = prompt.num_tokens
    dtype = next(model.parameters()).dtype
    cache = ContiguousKVCache(t.num_hidden_layers, 1, n, t.num_key_value_heads, t.head_dim, dtype)
    hidden = model(prefill_embeds(model, prompt, torch.device("cpu")), torch.from_numpy(prompt.mrope_positions),
                   cache, AttentionMetadata([n], [0]))
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
