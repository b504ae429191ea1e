"""LLaVA-OneVision's language model: the Qwen2 decoder (q/k/v bias, grouped-query attention) with 1-D RoPE.

Role: `qwen2_vl.language`'s decoder (it takes ready cos/sin) with a plain 1-D rotary table over
(1, num_tokens) positions. What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

from mmserve.models.layers.rotary import RotaryEmbedding
from mmserve.models.llava_onevision.config import TextConfig
from mmserve.models.qwen2_vl.language import Qwen2LanguageModel


def qwen2_language_model(cfg: TextConfig) -> Qwen2LanguageModel:
    return Qwen2LanguageModel(cfg, RotaryEmbedding(cfg.head_dim, cfg.rope_theta))
