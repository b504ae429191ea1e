"""Test helpers: load mmserve's model/processor for a checkpoint and compute full-prompt logits."""

from __future__ import annotations

import pytest
import torch

from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.media import MediaLimits
from mmserve.models.generation import prefill_inputs, prefill_metadata, prompt_cross_kv, prompt_positions
from mmserve.models.layers.attention import ContiguousKVCache
from mmserve.models.loader import load_model, read_config
from mmserve.models.registry import resolve
from mmserve.models.spec import FamilySpec
from tests.fixtures.conversations import image_part, random_image, text_part, user  # noqa: F401 (re-exported)


def load_processor(model_dir):
    """The family's processor for a checkpoint, without loading weights."""
    family = resolve(read_config(model_dir))
    return family.processor_class(model_dir, family.parse_config(read_config(model_dir)), MediaLimits())


NO_CUDA_REASON = "no CUDA device: the CUDA parity runs on a GPU machine (scripts/gpu_check.sh)"


def devices() -> list:
    """pytest params of the devices a parity suite runs on: "cpu", and "cuda", skipped (the reason shows
    in the summary, `-ra`) where no CUDA device exists."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason=NO_CUDA_REASON))]


def to_device(inputs: dict, device) -> dict:
    """A reference model's keyword inputs with every tensor moved to `device`."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def load_family(model_dir, dtype: str = "float32", device: str = "cpu"):
    """(model, processor, spec) for a checkpoint, as the engine builds them."""
    family = resolve(read_config(model_dir))
    model = load_model(model_dir, dtype, device)
    processor = family.processor_class(model_dir, model.config, MediaLimits())
    return model, processor, family.build_spec(model.config, processor, MediaLimits())


def load_pair(model_dir):
    model, processor, _ = load_family(model_dir)
    return model, processor


@torch.inference_mode()
def full_logits(model, prompt: ProcessedPrompt, spec: FamilySpec) -> torch.Tensor:
    """(num_tokens, vocab) logits of a whole prompt in one prefill, on the model's device."""
    layout = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    n = prompt.num_tokens
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cache = ContiguousKVCache(layout[0], 1, n, layout[1], layout[2], dtype, device)
    embeds, extra = prefill_inputs(model, prompt, device)
    meta = prefill_metadata(prompt, spec, prompt_cross_kv(model, prompt))
    hidden = model(embeds, prompt_positions(prompt, 0, n, device), cache, meta, extra)
    return model.compute_logits(hidden)


REFERENCE_IMAGE_PART = {"type": "image"}
REFERENCE_VIDEO_PART = {"type": "video"}
