"""Qwen2-VL / Qwen2.5-VL: vision tower + language model, and the checkpoint name mapping.

Role: encode items into embedding rows (the runner fuses them into the token embeddings), run the
decoder over the fused embeddings, compute logits; `load_weights` maps Hugging Face parameter names
(the hub's `model.*`/`visual.*` layout and transformers 5's `model.language_model.*`/`model.visual.*`)
onto this module, stacking q/k/v and gate/up projections. What it does not know: files,
tokenizers, scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.qwen2_vl.config import Qwen2VLConfig
from mmserve.models.qwen2_vl.language import qwen2_language_model
from mmserve.models.qwen2_vl.processor import VisionInput
from mmserve.models.qwen2_vl.vision import VisionTransformer
from mmserve.models.qwen2_vl.vision_graph import Qwen2VisionGraphAdapter
from mmserve.models.vision.segment_attention import GridTHW


class Qwen2VLForConditionalGeneration(LanguageModelCalls, nn.Module):
    def __init__(self, config: Qwen2VLConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config.vision)
        self.language_model = qwen2_language_model(config.text)

    # ---- forward pieces -------------------------------------------------------------------
    def encode(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        """Embedding rows for a batch of items, concatenated in item order."""
        return self.visual(pixel_values, grids)

    def encode_items(self, payloads: Sequence[VisionInput]) -> list[torch.Tensor]:
        """One (1, rows, hidden) tensor per item (one embedding stream): views into one batched output."""
        device = self.encoder_device
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
        grids = [p.grid_thw for p in payloads]
        unit = self.config.vision.spatial_merge_size ** 2
        rows = self.encode(pixels.to(device, non_blocking=True), grids)
        return [r[None] for r in rows.split([t * h * w // unit for t, h, w in grids])]

    def encoder_graph_adapter(self) -> Qwen2VisionGraphAdapter:
        """The vision tower laid out for captured graphs (runner/graphs/encoder_graphs.py)."""
        return Qwen2VisionGraphAdapter(self.visual)

    # ---- weights --------------------------------------------------------------------------
    @staticmethod
    def map_name(hf_name: str) -> str:
        """Hugging Face parameter name -> this module's name (before stacking)."""
        for prefix, ours in (("model.visual.", "visual."), ("visual.", "visual."),
                             ("model.language_model.", "language_model."), ("model.", "language_model."),
                             ("lm_head.", "language_model.lm_head.")):
            if hf_name.startswith(prefix):
                return ours + hf_name[len(prefix):]
        return hf_name

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = self.map_name(hf_name)
        if name == "visual.patch_embed.proj.weight":  # Conv3d over one patch == a matmul
            return "visual.patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
        if name.startswith("language_model.lm_head.") and self.config.text.tie_word_embeddings:
            return None  # tied: the embedding matrix is the head
        return name, tensor
