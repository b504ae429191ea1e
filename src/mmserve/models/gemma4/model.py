"""Gemma 4: the decoder, and (when the checkpoint has them) the vision and audio towers with their
projectors, plus the checkpoint name mapping.

Role: encode items (images and video frames through the vision tower, clips through the audio tower;
each modality's items in one batch), run the decoder — which reads the step's token ids for its
per-layer embeddings —, compute logits. `load_weights` maps Hugging Face names onto this module: the
decoder's (`model.language_model.*`) with q/k/v and gate/up stacked per layer (a layer's own shard
sizes: its head size, a KV-shared layer's q alone), the towers' and projectors' by prefix. A KV-shared
layer's k/v projections and norms, which a checkpoint may carry, are never used (transformers skips
them too); a tied LM head is the embedding.

What it does not know: files, tokenizers, where pixels or samples came from, scheduling.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.gemma4.audio_config import parse_audio_config
from mmserve.models.gemma4.audio_input import Gemma4AudioInput
from mmserve.models.gemma4.audio_tower import Gemma4AudioEncoder, audio_weight_name
from mmserve.models.gemma4.config import Gemma4Config
from mmserve.models.gemma4.image_processing import Gemma4VisionInput
from mmserve.models.gemma4.language import Gemma4TextModel
from mmserve.models.gemma4.vision import Gemma4VisionEncoder, vision_weight_name
from mmserve.models.gemma4.vision_config import parse_vision_config
from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.models.weights import StackedParam, loadable_tensors

# the decoder's projections only: the towers' are `*.q_proj.linear.weight` (clippable linears), left alone
STACKED = tuple(StackedParam(f".{hf}.{kind}", f".{ours}.{kind}", shard) for kind in ("weight", "bias")
                for hf, ours, shard in (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1),
                                        ("v_proj", "qkv_proj", 2), ("gate_proj", "gate_up_proj", 0),
                                        ("up_proj", "gate_up_proj", 1)))
_LAYER = re.compile(r"layers\.(\d+)\.")
_SHARED_ONLY = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")
# a MoE layer's expert half sits in our `moe` submodule
_MOE = re.compile(r"^(layers\.\d+\.)(router\.|experts\.|pre_feedforward_layernorm_2\.|post_feedforward_layernorm_2\.)")


class Gemma4ForConditionalGeneration(LanguageModelCalls, nn.Module):
    stacked = STACKED

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.config = config
        self.language_model = Gemma4TextModel(config.text, config.media_token_ids)
        hidden = config.text.hidden_size
        self.vision = None if config.vision is None else Gemma4VisionEncoder(parse_vision_config(config.vision), hidden)
        self.audio = None if config.audio is None else Gemma4AudioEncoder(parse_audio_config(config.audio), hidden)

    # ---- runner calls -------------------------------------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, backend, meta, extra_streams, token_ids)

    def encode_items(self, payloads: Sequence[Any]) -> list[torch.Tensor]:
        """One (1, rows, hidden) tensor per item, each tower's items encoded as one batch."""
        out: list[torch.Tensor | None] = [None] * len(payloads)
        for tower, kind in ((self.vision, Gemma4VisionInput), (self.audio, Gemma4AudioInput)):
            indices = [i for i, p in enumerate(payloads) if isinstance(p, kind)]
            if not indices:
                continue
            if tower is None:
                raise ValueError(f"a {kind.__name__} item for a checkpoint without that tower")
            for i, rows in zip(indices, tower.encode([payloads[i] for i in indices])):
                out[i] = rows.unsqueeze(0)
        return out

    # ---- weights --------------------------------------------------------------------------------
    def map_name(self, hf_name: str) -> str | None:
        """Hugging Face parameter name -> this module's (before stacking); None: never used here. An
        unknown name passes through unchanged (and is reported as unexpected)."""
        name = hf_name.removeprefix("model.")
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.").removeprefix("model.")
            match = _LAYER.match(name)
            if match and self.config.text.is_kv_shared(int(match.group(1))) and any(
                    part in name for part in _SHARED_ONLY):
                return None
            return "language_model." + _MOE.sub(r"\1moe.\2", name)
        if name.startswith("lm_head."):
            return "language_model." + name
        for prefix, rename in (("vision.", vision_weight_name), ("audio.", audio_weight_name)):
            ours = rename(hf_name)
            if ours is not None:
                return prefix + ours
        return hf_name

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = self.map_name(hf_name)
        if name is None or (name == "language_model.lm_head.weight" and self.config.text.tie_word_embeddings):
            return None
        return name, tensor

    def _shard_sizes(self, name: str, param: torch.Tensor) -> list[int]:
        if ".qkv_proj." in name:
            layer = int(_LAYER.search(name).group(1))
            return list(self.language_model.layers[layer].self_attn.widths)
        return [param.shape[0] // 2] * 2  # gate/up

    def expected_weight_names(self) -> set[str]:
        """Every tensor the checkpoint fills; a stacked one per shard it has on that layer."""
        out = set()
        for name, tensor in loadable_tensors(self).items():
            if name.startswith("language_model.") and (".qkv_proj." in name or ".gate_up_proj." in name):
                out.update(f"{name}#{i}" for i in range(len(self._shard_sizes(name, tensor))))
            else:
                out.add(name)
        return out
