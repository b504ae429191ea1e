"""Test helpers: load mmserve's model/processor for a checkpoint and compute full-prompt logits."""

from __future__ import annotations

import pytest
import torch

from testkit.conversations import image_part, random_image, text_part, user  # noqa: F401 (re-exported)
from testkit.models import full_logits, load_family, load_processor  # noqa: F401 (re-exported)

NO_CUDA_REASON = "no CUDA device: the CUDA parity runs on a GPU machine (scripts/gpu_check.sh)"


def devices() -> list:
    """pytest params of the devices a parity suite runs on: "cpu", and "cuda", skipped (the reason shows
    in the summary, `-ra`) where no CUDA device exists."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason=NO_CUDA_REASON))]


def to_device(inputs: dict, device) -> dict:
    """A reference model's keyword inputs with every tensor moved to `device`."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def load_pair(model_dir):
    model, processor, _ = load_family(model_dir)
    return model, processor


REFERENCE_IMAGE_PART = {"type": "image"}
REFERENCE_VIDEO_PART = {"type": "video"}


def reference_inputs(model_dir, family: str, messages) -> dict:
    """The inputs transformers' model of `family` takes for one conversation, through mmserve's processor."""
    from testkit.families import FAMILIES

    processor = load_processor(model_dir)
    chat = processor.render_chat(messages)
    prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos, audios=chat.audios)
    return FAMILIES[family].reference_kwargs(model_dir, messages, prompt)
