"""The Qwen2 decoder of Qwen2-VL / Qwen2.5-VL: the shared decoder with q/k/v biases and M-RoPE.

Role: build `layers.decoder.DecoderLM` for this family's text config; forward takes (3, num_tokens)
M-RoPE positions. What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

from mmserve.models.layers.decoder import DecoderLM, DecoderOptions
from mmserve.models.layers.rotary import MRotaryEmbedding
from mmserve.models.qwen2_vl.config import TextConfig


def qwen2_language_model(cfg: TextConfig) -> DecoderLM:
    return DecoderLM(cfg, MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section),
                     DecoderOptions(qkv_bias=True, o_bias=False))
