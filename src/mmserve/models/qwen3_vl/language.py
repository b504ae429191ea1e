"""The Qwen3 decoder of Qwen3-VL: q/k RMSNorm, explicit head_dim, interleaved M-RoPE, deepstack.

Role: the interleaved M-RoPE table, and the shared `layers.decoder.DecoderLM` built for this family:
forward takes (3, num_tokens) positions; deepstack: after decoder layer i (i < number of extra
streams) the i-th extra embedding stream is added to the hidden states; the streams are zero at
text rows, so only media rows change.
What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

from mmserve.models.layers.decoder import DecoderLM, DecoderOptions, MoeOptions
from mmserve.models.layers.rotary import InterleavedMRotaryEmbedding
from mmserve.models.qwen3_vl.config import TextConfig


def qwen3_language_model(cfg: TextConfig) -> DecoderLM:
    """Qwen3: per-head q/k RMSNorm, `attention_bias` on q/k/v and the output, interleaved M-RoPE; the
    deepstack streams arrive as the decoder's extra streams."""
    moe = MoeOptions(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.sparse_layers) \
        if cfg.num_experts else None
    return DecoderLM(cfg, InterleavedMRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section),
                     DecoderOptions(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, moe=moe))
