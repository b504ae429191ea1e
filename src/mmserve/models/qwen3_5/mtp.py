"""Qwen3.5's multi-token-prediction head (`mtp.*` in hub checkpoints), a drafter for speculative decoding.

Role: for a position t whose next token x(t+1) is known, it joins the token's embedding and the target's
final hidden state at t (each through its own zero-centred RMSNorm, concatenated, then `fc` back to the
hidden size), runs one full-attention decoder layer of the target's shape with its own KV cache, and a final
norm: a hidden state whose logits (the target's LM head) guess x(t+2). Fed its own output and its guess it
guesses further. Parameter names are the checkpoint's with `mtp.` dropped (`fc`, `layers.0.*`, `norm`,
`pre_fc_norm_hidden`, `pre_fc_norm_embedding`); the embedding table, rotary tables and LM head are the
target's, passed in.

What it does not know: requests, scheduling, which tokens are drafts, where its KV lives.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from mmserve.models.layers.attention import AttentionMetadata
from mmserve.models.layers.rotary import InterleavedMRotaryEmbedding
from mmserve.models.qwen3_5.config import FULL, Qwen35Config
from mmserve.models.qwen3_5.language import HybridBackend, HybridLayer, ZeroCentredRMSNorm
from mmserve.models.weights import QKV_GATE_UP, CheckpointWeights


class Qwen35MtpHead(CheckpointWeights, nn.Module):
    stacked = QKV_GATE_UP

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        text = config.text
        # the head's one layer: a full-attention layer of the target's shape, its KV cache number 0
        one_layer = replace(text, num_hidden_layers=1, layer_types=(FULL,))
        self.fc = nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False)
        self.layers = nn.ModuleList([HybridLayer(one_layer, 0)])
        self.norm = ZeroCentredRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.rotary = InterleavedMRotaryEmbedding(text.rotary_dim, text.rope_theta, text.mrope_section)  # the target's

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return (hf_name[len("mtp."):], tensor) if hf_name.startswith("mtp.") else None

    def _shard_sizes(self, name: str, param: torch.Tensor) -> list[int]:
        owner = self.get_submodule(name.rsplit(".", 2)[0])  # the attention or MLP that stacks this projection
        if hasattr(owner, "shard_sizes"):
            return owner.shard_sizes()
        return super()._shard_sizes(name, param)

    def forward(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                backend: HybridBackend, meta: AttentionMetadata) -> torch.Tensor:
        """token_embeds (the target's embedding of each next token), target_hidden (num_tokens, hidden); positions
        (3, num_tokens), the target's -> (num_tokens, hidden), normed (the target's LM head reads it)."""
        cos, sin = self.rotary(positions, token_embeds.dtype)
        joined = torch.cat([self.pre_fc_norm_embedding(token_embeds), self.pre_fc_norm_hidden(target_hidden)], dim=-1)
        return self.norm(self.layers[0](self.fc(joined), cos, sin, backend, meta))
