"""LLaVA-OneVision's language model: the Qwen2 decoder (q/k/v bias, grouped-query attention) with 1-D RoPE.

Role: build the shared `layers.decoder.DecoderLM` with a plain 1-D rotary table over (1, num_tokens)
positions. What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

from mmserve.models.layers.decoder import DecoderLM, DecoderOptions
from mmserve.models.layers.rotary import RotaryEmbedding
from mmserve.models.llava_onevision.config import TextConfig


def qwen2_language_model(cfg: TextConfig) -> DecoderLM:
    return DecoderLM(cfg, RotaryEmbedding(cfg.head_dim, cfg.rope_theta), DecoderOptions(qkv_bias=True, o_bias=False))
