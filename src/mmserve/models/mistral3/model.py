"""Mistral 3: Pixtral encoder + Mistral 3 projector + Mistral decoder, and the checkpoint name mapping.

Role: encode a batch of images into one embedding stream of rows per image (all images' patches in
one encoder call, attention blocked per image), run the decoder, compute logits. `load_weights` maps
Hugging Face names — the hub layout (`language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.*`, `multi_modal_projector.*`, which transformers 5 still writes) and transformers 5's
module layout (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`) — onto this module,
stacking q/k/v and gate/up projections, flattening the patch conv into a matmul and skipping
encoder blocks past the feature layer.

Tied embeddings follow transformers 5: `tie_word_embeddings` (Mistral3Config's, default True) ties
the LM head to the embeddings unless the checkpoint carries a head of its own — as Mistral Small
3.1 on the hub does, whose config.json leaves the field out — and then that head is used.

What it does not know: files, tokenizers, `[IMG_BREAK]` rows (the runner fuses rows at the embed
mask), scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.mistral3.config import Mistral3Config
from mmserve.models.mistral3.language import mistral_language_model
from mmserve.models.mistral3.processor import ImageInput
from mmserve.models.mistral3.vision import Mistral3Projector, PixtralVisionEncoder

# hf prefix -> ours, first match wins
_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
)
LM_HEAD = "language_model.lm_head.weight"


class Mistral3ForConditionalGeneration(LanguageModelCalls, nn.Module):
    def __init__(self, config: Mistral3Config) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = PixtralVisionEncoder(config.vision, config.vision_feature_layer)
        self.multi_modal_projector = Mistral3Projector(config)
        self.language_model = mistral_language_model(config.text)

    # ---- encoder --------------------------------------------------------------------------
    def encode_items(self, payloads: Sequence[ImageInput]) -> list[torch.Tensor]:
        """One (1, rows, hidden) tensor per image: views into one batched output."""
        device = self.encoder_device
        patches = torch.from_numpy(np.concatenate([p.patches for p in payloads]))
        grids = [p.grid_hw for p in payloads]
        features = self.vision_tower(patches.to(device, non_blocking=True), grids)
        rows = self.multi_modal_projector(features, grids)
        unit = self.config.spatial_merge_size ** 2
        return [r[None] for r in rows.split([h * w // unit for h, w in grids])]

    # ---- weights --------------------------------------------------------------------------
    @staticmethod
    def map_name(hf_name: str) -> str:
        for prefix, ours in _PREFIXES:
            if hf_name.startswith(prefix):
                return ours + hf_name[len(prefix):]
        return hf_name  # vision_tower.* and multi_modal_projector.* already match

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = self.map_name(hf_name)
        if name == "vision_tower.patch_conv.weight":  # conv kernel (hidden, C, P, P) -> matmul
            tensor = tensor.reshape(tensor.shape[0], -1)
        parts = name.split(".")
        if parts[:3] == ["vision_tower", "transformer", "layers"] and \
                int(parts[3]) >= len(self.vision_tower.transformer.layers):
            return None  # past the feature layer: never run
        return name, tensor

    def _untie(self, head: torch.Tensor) -> None:
        """Give the decoder its own LM head, filled from the checkpoint's."""
        embeddings = self.language_model.embed_tokens.weight
        if head.shape != embeddings.shape:
            raise ValueError(f"tensor {LM_HEAD!r} has shape {tuple(head.shape)}, expected {tuple(embeddings.shape)}")
        linear = nn.Linear(embeddings.shape[1], embeddings.shape[0], bias=False, device=embeddings.device,
                           dtype=embeddings.dtype)
        with torch.no_grad():
            linear.weight.copy_(head)
        self.language_model.lm_head = linear

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy checkpoint tensors in. Returns (names of our parameters filled, unexpected hf names).

        Raises ValueError naming the tensor on a shape mismatch."""
        heads: list[torch.Tensor] = []

        def set_heads_aside(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in items:
                if self.language_model.lm_head is None and self.map_name(hf_name) == LM_HEAD:
                    heads.append(tensor)  # tied in the config, yet the checkpoint has a head: it wins
                    continue
                yield hf_name, tensor

        loaded, unexpected = super().load_weights(set_heads_aside(weights))
        if heads:
            self._untie(heads[-1])
            loaded.add(LM_HEAD)
        return loaded, unexpected
