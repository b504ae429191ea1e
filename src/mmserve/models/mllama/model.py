"""Llama 3.2 Vision (`MllamaForConditionalGeneration`): tile encoder + projector + cross-attending decoder, and
the checkpoint name mapping.

Role: encode a batch of images (each its own padded tiles: one (1, max_num_tiles * num_patches, text
hidden) output per image, padded tiles included, as transformers' language model reads them), turn a
request's image rows into every cross-attention layer's keys and values (`cross_attention_kv`), run the
decoder, compute logits. `load_weights` maps the hub's names (`language_model.model.*`,
`language_model.lm_head.*`, `vision_model.*`, `multi_modal_projector.*`) and transformers 5's module
names (`model.language_model.*`, `model.vision_model.*`, `lm_head.*`) onto this module, stacking the
self-attention layers' q/k/v and every MLP's gate/up.

What it does not know: files, tokenizers, which text a query sees of which image, scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.mllama.config import MllamaConfig
from mmserve.models.mllama.language import MllamaTextModel
from mmserve.models.mllama.vision import MllamaVisionEncoder, map_weight_name
from mmserve.models.weights import StackedParam, decoder_shard_sizes, expected_weight_names, load_weights

# only the language model's self-attention q/k/v are stacked (the vision tower's and the cross-attention
# layers' stay apart); every gate/up pair is (the vision tower has none)
STACKED = (
    StackedParam(".self_attn.q_proj.", ".self_attn.qkv_proj.", 0),
    StackedParam(".self_attn.k_proj.", ".self_attn.qkv_proj.", 1),
    StackedParam(".self_attn.v_proj.", ".self_attn.qkv_proj.", 2),
    StackedParam(".gate_proj.", ".gate_up_proj.", 0),
    StackedParam(".up_proj.", ".gate_up_proj.", 1),
)
# hf prefix -> ours, first match wins (the vision side: vision.map_weight_name)
_LM_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
)


@dataclass(frozen=True)
class MllamaImage:
    """One image's encoder input: its tiles padded to the tower's `max_num_tiles`."""

    pixel_values: np.ndarray  # (max_num_tiles, 3, tile_px, tile_px) float32, zero tiles after the real ones
    aspect_ratio_id: int  # 1-based grid id
    num_tiles: int  # real tiles (the first ones)


class MllamaForConditionalGeneration(LanguageModelCalls, nn.Module):
    def __init__(self, config: MllamaConfig) -> None:
        super().__init__()
        if config.text is None:
            raise ValueError("MllamaForConditionalGeneration needs the text config")
        self.config = config
        self.encoder = MllamaVisionEncoder(config)
        self.language_model = MllamaTextModel(config.text)

    # ---- encoder --------------------------------------------------------------------------
    def encode_items(self, payloads: Sequence[MllamaImage]) -> list[torch.Tensor]:
        """One (1, max_num_tiles * num_patches, text hidden) tensor per image: views into one batched output."""
        device = self.encoder_device
        tiles = self.config.vision.max_num_tiles
        pixels = torch.from_numpy(np.stack([p.pixel_values for p in payloads]))[:, None]
        ids = torch.tensor([[p.aspect_ratio_id] for p in payloads], dtype=torch.int64)
        mask = torch.tensor([[[1] * p.num_tiles + [0] * (tiles - p.num_tiles)] for p in payloads], dtype=torch.int64)
        states = self.encoder(pixels.to(device, non_blocking=True), ids.to(device), mask.to(device))
        return [s[None] for s in states]

    def cross_attention_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A request's image rows (rows, hidden) -> (keys, values) per cross-attention layer."""
        return self.language_model.cross_attention_kv(states.to(self.language_model.embed_tokens.weight.dtype))

    # ---- weights --------------------------------------------------------------------------
    @staticmethod
    def map_name(hf_name: str) -> str | None:
        vision = map_weight_name(hf_name)
        if vision is not None:
            return "encoder." + vision
        for prefix, ours in _LM_PREFIXES:
            if hf_name.startswith(prefix):
                return ours + hf_name[len(prefix):]
        return None

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = self.map_name(hf_name)
        if name is None:
            return hf_name, tensor  # reported as unexpected
        if name == "language_model.lm_head.weight" and self.language_model.lm_head is None:
            return None  # tied
        return name, tensor

    def _shard_sizes(self, name: str, param: torch.Tensor) -> list[int]:
        return decoder_shard_sizes(name, param, self.config.text)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy checkpoint tensors in. Returns (names of our parameters filled, unexpected hf names). The
        vision tower's tensors go in a second pass without stacking: its q/k/v have the same names."""
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if map_weight_name(name) is None:
                    yield name, tensor
                else:
                    vision.append((name, tensor))

        loaded, unexpected = load_weights(self, text(), self._rename, STACKED, self._shard_sizes)
        more, stray = load_weights(self, vision, self._rename, (), self._shard_sizes)
        return loaded | more, unexpected + stray

    def expected_weight_names(self) -> set[str]:
        return expected_weight_names(self, STACKED)

