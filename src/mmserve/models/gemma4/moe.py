"""Gemma 4's sparse experts (the 26B-A4B model's): a router of its own and experts beside the dense MLP.

Role: the router norms the layer's input without a scale, multiplies it by a learned per-channel scale
and 1/sqrt(hidden), takes a float32 softmax over the experts, keeps the top k renormalised to sum to one
and multiplies each by its expert's learned scale; the experts (gated gelu MLPs, gate and up in one
matrix) are held as transformers holds them — `gate_up_proj` (experts, 2 * inter, hidden) and `down_proj`
(experts, hidden, inter) — so a checkpoint loads by name. Tokens are grouped by expert, one matmul pair per
chosen expert, summed back per token in ascending expert order, as transformers does.

What it does not know: attention, KV, the dense MLP it sits beside (the decoder layer combines them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.gemma4.blocks import Gemma4RMSNorm
from mmserve.models.gemma4.config import TextConfig
from mmserve.models.layers.activations import get_activation


class Gemma4Router(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.top_k = int(cfg.top_k_experts or 1)
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, int(cfg.num_experts or 1), bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(int(cfg.num_experts or 1)))
        self.root = cfg.hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (n, hidden) -> (weights (n, k) float32, expert ids (n, k))."""
        scores = self.proj(self.norm(x) * self.scale * self.root)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Gemma4Experts(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        experts, inter = int(cfg.num_experts or 1), int(cfg.moe_intermediate_size or 1)
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(experts, cfg.hidden_size, inter))
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, in token order
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist()):
            pairs = order[start:start + count]
            start += count
            tokens = pairs // k
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = F.linear(self.act(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, (h * weights.reshape(-1)[pairs, None]).to(out.dtype))
        return out


class Gemma4Moe(nn.Module):
    """The expert half of a MoE layer's feed-forward: its output, normed, is added to the dense MLP's."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.router = Gemma4Router(cfg)
        self.experts = Gemma4Experts(cfg)
        self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, hidden): the layer's input after attention (the dense MLP's residual)."""
        weights, index = self.router(x)
        return self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(x), weights, index))
