"""Mistral 3's language model: the Mistral decoder (Llama layout, no biases, grouped-query attention,
explicit head_dim, every layer windowed when `sliding_window` is set) with plain 1-D RoPE.

Role: build the shared `layers.decoder.DecoderLM` for this family; forward takes (1, num_tokens)
positions. What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

from mmserve.models.layers.decoder import DecoderLM, DecoderOptions
from mmserve.models.layers.rotary import RotaryEmbedding
from mmserve.models.mistral3.config import TextConfig


def mistral_language_model(cfg: TextConfig) -> DecoderLM:
    return DecoderLM(cfg, RotaryEmbedding(cfg.head_dim, cfg.rope_theta),
                     DecoderOptions(qkv_bias=False, sliding_window=cfg.sliding_window))
