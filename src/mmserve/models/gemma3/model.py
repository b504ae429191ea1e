"""Gemma 3: SigLIP tower + pooled projector + Gemma 3 decoder, and the checkpoint name mapping.

Role: encode items into embedding rows (all crops of all items in one batch through the tower and
the projector; each item's rows are its crops' rows in order: the whole image, then its crops),
run the decoder, compute logits. `load_weights` maps Hugging Face names onto this module — the
hub's layout (`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`),
transformers 5's (`model.language_model.*`, `model.vision_tower.*`, ...) and the mix transformers 5
saves — stacking q/k/v and gate/up projections, flattening the patch conv into a matmul, and
dropping SigLIP's pooling head (Gemma 3 reads the last hidden state) and a tied LM head.

What it does not know: files, tokenizers, pixels' origin, scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.gemma3.config import Gemma3Config
from mmserve.models.gemma3.language import Gemma3TextModel
from mmserve.models.gemma3.processor import ImageInput
from mmserve.models.gemma3.vision import Gemma3VisionEncoder

# hf prefix (after an optional leading "model.") -> ours; first match wins; None: not used by this model
_PREFIXES: tuple[tuple[str, str | None], ...] = (
    ("vision_tower.vision_model.embeddings.", "vision.tower."),
    ("vision_tower.vision_model.encoder.", "vision.tower."),
    ("vision_tower.vision_model.post_layernorm.", "vision.post_layernorm."),
    ("vision_tower.vision_model.head.", None),
    ("vision_tower.embeddings.", "vision.tower."),
    ("vision_tower.encoder.", "vision.tower."),
    ("vision_tower.post_layernorm.", "vision.post_layernorm."),
    ("vision_tower.head.", None),
    ("multi_modal_projector.", "vision.projector."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("language_model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
)


class Gemma3ForConditionalGeneration(LanguageModelCalls, nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.vision = Gemma3VisionEncoder(config)
        self.language_model = Gemma3TextModel(config.text)

    # ---- encoder --------------------------------------------------------------------------
    def encode_items(self, payloads: Sequence[ImageInput]) -> list[torch.Tensor]:
        """One (1, crops * mm_tokens_per_image, hidden) tensor per item: views into one batched output."""
        device = self.encoder_device
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
        rows = self.vision(pixels.to(device, non_blocking=True))  # (all crops, mm_tokens, hidden)
        return [r.reshape(1, -1, rows.shape[-1]) for r in rows.split([len(p.pixel_values) for p in payloads])]

    # ---- weights --------------------------------------------------------------------------
    def map_name(self, hf_name: str) -> str | None:
        """Hugging Face parameter name -> this module's name (before stacking); None for tensors this model
        never uses. An unknown name passes through unchanged (and is reported as unexpected)."""
        name = hf_name.removeprefix("model.")
        for prefix, ours in _PREFIXES:
            if name.startswith(prefix):
                return None if ours is None else ours + name[len(prefix):]
        return hf_name

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = self.map_name(hf_name)
        if name is None:
            return None
        if name == "language_model.lm_head.weight" and self.config.text.tie_word_embeddings:
            return None  # tied: the embedding matrix is the head
        if name == "vision.tower.patch_embedding.weight":  # conv kernel (hidden, C, P, P) -> matmul
            tensor = tensor.reshape(tensor.shape[0], -1)
        return name, tensor
