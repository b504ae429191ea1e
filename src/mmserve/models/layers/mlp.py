"""Feed-forward blocks: the gated SwiGLU MLP with a fused gate/up projection, and the plain two-layer MLP of
vision towers (`fc1`, activation, `fc2`, with biases)."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers.activations import get_activation


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are one matmul (`gate_up_proj`, gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        hidden = self.act(gate)
        if not (hidden.requires_grad and torch.is_grad_enabled()):  # inference: no extra temporary
            return self.down_proj(hidden.mul_(up))
        return self.down_proj(hidden * up)


class FeedForward(nn.Module):
    """fc2(act(fc1(x))), both with biases: a vision tower's MLP (Qwen2-VL's, SigLIP's, Llama 3.2 Vision's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
