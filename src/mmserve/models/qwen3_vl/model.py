"""Qwen3-VL: vision tower (with deepstack) + Qwen3 language model, and the checkpoint name mapping.

Role: encode items into (1 + num_deepstack) embedding streams of rows, run the decoder (which adds
the deepstack streams after its first layers), compute logits; `load_weights` maps Hugging Face
parameter names (`model.visual.*`, `model.language_model.*`, `lm_head.*`) onto this module,
stacking q/k/v and gate/up projections and flattening the patch Conv3d into a matmul.
What it does not know: files, tokenizers, scheduling.
"""

from __future__ import annotations

from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.qwen3_vl.config import Qwen3VLConfig
from mmserve.models.qwen3_vl.language import qwen3_language_model
from mmserve.models.vision.qwen3_vision import Qwen3StyleCalls, VisionTransformer


class Qwen3VLForConditionalGeneration(Qwen3StyleCalls, LanguageModelCalls, nn.Module):
    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config.vision)
        self.language_model = qwen3_language_model(config.text)
