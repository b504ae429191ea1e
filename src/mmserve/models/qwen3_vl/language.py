"""The Qwen3 decoder of Qwen3-VL: q/k RMSNorm, explicit head_dim, interleaved M-RoPE, deepstack.

Role: the interleaved M-RoPE table, and the shared `layers.decoder.DecoderLM` built for this family:
forward takes (3, num_tokens) positions; deepstack: after decoder layer i (i < number of extra
streams) the i-th extra embedding stream is added to the hidden states; the streams are zero at
text rows, so only media rows change.
What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

import torch

from mmserve.models.layers.decoder import DecoderLM, DecoderOptions
from mmserve.models.layers.rotary import MRotaryEmbedding
from mmserve.models.qwen3_vl.config import TextConfig


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with the (t, h, w) sections interleaved over the frequency bands, as Qwen3-VL does:
    band j follows h when j % 3 == 1 and j < 3 * h_section, w when j % 3 == 2 and j < 3 * w_section,
    and t otherwise."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int]) -> None:
        super().__init__(head_dim, theta, mrope_section)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for row, offset in ((1, 1), (2, 2)):
            axis[offset:3 * mrope_section[row]:3] = row
        self.register_buffer("band_axis", axis, persistent=False)


def qwen3_language_model(cfg: TextConfig) -> DecoderLM:
    """Qwen3: per-head q/k RMSNorm, `attention_bias` on q/k/v and the output, interleaved M-RoPE; the
    deepstack streams arrive as the decoder's extra streams."""
    return DecoderLM(cfg, InterleavedMRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section),
                     DecoderOptions(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True))
