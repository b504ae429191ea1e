"""Qwen3.5: the Qwen3-VL vision tower (no deepstack) + the hybrid DeltaNet/attention decoder, and the
checkpoint name mapping.

Role: encode items into rows, run the hybrid decoder, compute logits; `load_weights` maps Hugging Face names
(`model.visual.*`, `model.language_model.*`, `lm_head.*`) onto this module, stacking each full-attention
layer's q/k/v (q twice as wide: it carries the output gate), gate/up, and each DeltaNet layer's four input
projections (qkv, z, b, a). The multi-token-prediction head (`mtp.*`) is not part of this model: its tensors
are skipped, never an error.

What it does not know: files, tokenizers, scheduling, where KV and state live.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.family_model import LanguageModelCalls
from mmserve.models.qwen3_5.config import Qwen35Config
from mmserve.models.qwen3_5.language import HybridLM
from mmserve.models.vision.qwen3_vision import Qwen3StyleCalls, VisionTransformer
from mmserve.models.weights import QKV_GATE_UP, StackedParam, even_shards

STACKED = (*QKV_GATE_UP,
           StackedParam(".in_proj_qkv.", ".in_proj.", 0), StackedParam(".in_proj_z.", ".in_proj.", 1),
           StackedParam(".in_proj_b.", ".in_proj.", 2), StackedParam(".in_proj_a.", ".in_proj.", 3))


class Qwen35ForConditionalGeneration(Qwen3StyleCalls, LanguageModelCalls, nn.Module):
    stacked = STACKED
    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config.vision)
        self.language_model = HybridLM(config.text)

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if hf_name.startswith("mtp.") or ".mtp." in hf_name:
            return None  # the MTP head: a drafter's weights, not this model's
        return super()._rename(hf_name, tensor)

    def _shard_sizes(self, name: str, param: torch.Tensor) -> list[int]:
        if name.startswith("language_model."):
            owner = self.get_submodule(name.rsplit(".", 2)[0])  # the layer that stacks this projection
            if hasattr(owner, "shard_sizes"):
                return owner.shard_sizes()
        return even_shards(name, param, 3 if ".qkv_proj." in name else 2)
