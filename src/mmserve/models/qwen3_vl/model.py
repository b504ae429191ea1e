"""Qwen3-VL: vision tower (with deepstack) + Qwen3 language model, and the checkpoint name mapping.

Role: encode items into (1 + num_deepstack) embedding streams of rows, run the decoder (which adds
the deepstack streams after its first layers), compute logits; `load_weights` maps Hugging Face
parameter names (`model.visual.*`, `model.language_model.*`, `lm_head.*`) onto this module,
stacking q/k/v and gate/up projections and flattening the patch Conv3d into a matmul.
What it does not know: files, tokenizers, scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.qwen3_vl.config import Qwen3VLConfig
from mmserve.models.qwen3_vl.language import qwen3_language_model
from mmserve.models.qwen3_vl.processor import VisionInput
from mmserve.models.qwen3_vl.vision import VisionTransformer

_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model."),
             ("lm_head.", "language_model.lm_head."))


class Qwen3VLForConditionalGeneration(LanguageModelCalls, nn.Module):
    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config.vision)
        self.language_model = qwen3_language_model(config.text)

    # ---- forward pieces -------------------------------------------------------------------
    def encode_items(self, payloads: Sequence[VisionInput]) -> list[torch.Tensor]:
        """One (1 + num_deepstack, rows, hidden) tensor per item: views into one batched output."""
        device = self.encoder_device
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
        grids = [p.grid_thw for p in payloads]
        unit = self.config.vision.spatial_merge_size ** 2
        streams = self.visual(pixels.to(device, non_blocking=True), grids)  # (streams, rows, hidden)
        return list(streams.split([t * h * w // unit for t, h, w in grids], dim=1))

    # ---- weights --------------------------------------------------------------------------
    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Hugging Face parameter name -> this module's name (before stacking), or None to skip it."""
        name = hf_name
        for prefix, ours in _PREFIXES:
            if hf_name.startswith(prefix):
                name = ours + hf_name[len(prefix):]
                break
        name = name.replace("visual.patch_embed.proj.", "visual.patch_embed.")
        if name == "language_model.lm_head.weight" and self.config.text.tie_word_embeddings:
            return None  # tied: the embedding matrix is the head
        if name == "visual.patch_embed.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)  # (out, C, T, P, P) -> (out, C*T*P*P)
        return name, tensor
