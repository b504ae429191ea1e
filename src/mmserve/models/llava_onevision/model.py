"""LLaVA-OneVision: SigLIP tower + projector + Qwen2 decoder, and the checkpoint name mapping.

Role: encode items into embedding rows and run the decoder. All tiles and frames of a batch of items
go through the vision tower and the projector in one call; each item's rows are then assembled from
its own slice: an image's base tile, then its tiles' joint feature map unpadded, scaled down by the
`anyres_max_N` rule (bilinear) and closed by the learned `image_newline` row after every feature
row; a video's frames pooled 2x2 (bilinear, rounded up) and one newline row after the last frame.
Crops and sizes come from the payload (computed on the CPU from image sizes). `load_weights` maps
Hugging Face names (hub layout and transformers 5's `model.*` layout) onto this module, stacking
q/k/v and gate/up projections and dropping tower parts past the selected feature layer.
What it does not know: files, tokenizers, pixels' origin, scheduling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.layers.activations import get_activation
from mmserve.models.llava_onevision.config import LlavaOnevisionConfig
from mmserve.models.llava_onevision.language import qwen2_language_model
from mmserve.models.llava_onevision.processor import ImageInput, VideoInput
from mmserve.models.vision.siglip import SiglipVisionTower

# hf prefix -> ours, first match wins (after an optional leading "model.")
_PREFIXES = (
    ("vision_tower.vision_model.embeddings.", "vision_tower."),
    ("vision_tower.vision_model.encoder.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower.unused."),
    ("vision_tower.embeddings.", "vision_tower."),
    ("vision_tower.encoder.", "vision_tower."),
    ("vision_tower.", "vision_tower.unused."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("language_model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
)


class Projector(nn.Module):
    def __init__(self, config: LlavaOnevisionConfig) -> None:
        super().__init__()
        width = config.vision.hidden_size * len(config.vision_feature_layers)
        hidden, bias = config.text.hidden_size, config.multimodal_projector_bias
        self.linear_1 = nn.Linear(width, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.act = get_activation(config.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaOnevisionForConditionalGeneration(LanguageModelCalls, nn.Module):
    def __init__(self, config: LlavaOnevisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionTower(config.vision, config.resolved_feature_layers)
        self.multi_modal_projector = Projector(config)
        self.image_newline = nn.Parameter(torch.zeros(config.text.hidden_size))
        self.language_model = qwen2_language_model(config.text)
        self.side = config.vision.patches_per_side

    # ---- encoder --------------------------------------------------------------------------
    def encode_items(self, payloads: Sequence[ImageInput | VideoInput]) -> list[torch.Tensor]:
        """One (1, rows, hidden) tensor per item (one embedding stream)."""
        device = self.image_newline.device
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
        feats = self.multi_modal_projector(self.vision_tower(pixels.to(device, non_blocking=True)))
        out = []
        for p, f in zip(payloads, feats.split([len(p.pixel_values) for p in payloads])):
            rows = self._image_rows(p, f) if isinstance(p, ImageInput) else self._video_rows(f)
            out.append(rows[None])
        return out

    def _image_rows(self, payload: ImageInput, feats: torch.Tensor) -> torch.Tensor:
        """feats (1 + tiles, side^2, hidden) -> (rows, hidden): base tile, then the unpadded map by rows;
        an untiled image (one of several): its tile's rows, then one newline row."""
        if payload.layout is None:
            return torch.cat((feats[0], self.image_newline[None].to(feats.dtype)), dim=0)
        layout, s = payload.layout, self.side
        (grid_h, grid_w), (top, bottom, left, right) = layout.tile_grid, layout.crop
        # tiles row by row -> one (hidden, grid_h * s, grid_w * s) map
        fmap = feats[1:].view(grid_h, grid_w, s, s, -1).permute(4, 0, 2, 1, 3).reshape(-1, grid_h * s, grid_w * s)
        fmap = fmap[:, top:bottom, left:right]
        if layout.resized is not None:
            fmap = F.interpolate(fmap[None], size=list(layout.resized), mode="bilinear")[0]
        hidden, h, w = fmap.shape
        newline = self.image_newline.to(fmap.dtype).view(hidden, 1, 1).expand(hidden, h, 1)
        rows = torch.cat((fmap, newline), dim=2).flatten(1).transpose(0, 1)  # (h * (w + 1), hidden)
        return torch.cat((feats[0], rows), dim=0)

    def _video_rows(self, feats: torch.Tensor) -> torch.Tensor:
        """feats (frames, side^2, hidden) -> (frames * pooled^2 + 1, hidden)."""
        s, pooled = self.side, math.ceil(self.side / 2)
        frames = feats.view(feats.shape[0], s, s, -1).permute(0, 3, 1, 2)
        frames = F.interpolate(frames, size=[pooled, pooled], mode="bilinear").permute(0, 2, 3, 1)
        return torch.cat((frames.reshape(-1, feats.shape[-1]), self.image_newline[None].to(feats.dtype)), dim=0)

    # ---- weights --------------------------------------------------------------------------
    def map_name(self, hf_name: str) -> str | None:
        """Hugging Face parameter name -> this module's name (before stacking); None for tensors this
        model never uses (tower layers past the feature layer, post-layernorm, pooling head)."""
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        for prefix, ours in _PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        if name.startswith("vision_tower.unused."):
            return None
        if name.startswith("vision_tower.layers.") and int(name.split(".")[2]) >= len(self.vision_tower.layers):
            return None
        return name

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = self.map_name(hf_name)
        if name is None:
            return None
        if name == "vision_tower.patch_embedding.weight":  # conv kernel (hidden, C, P, P) -> matmul
            tensor = tensor.reshape(tensor.shape[0], -1)
        if name == "language_model.lm_head.weight" and self.config.text.tie_word_embeddings:
            return None  # tied: the embedding matrix is the head
        return name, tensor
