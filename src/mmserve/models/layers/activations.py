"""Activation functions by the names checkpoints use in their configs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mmserve.errors import ModelLoadError


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    if x.requires_grad and torch.is_grad_enabled():  # training: autograd needs the out-of-place ops
        return x * torch.sigmoid(1.702 * x)
    # inference: one temporary instead of three (memory-bound over the vision MLP's wide hidden);
    # the same products, so the same bits
    out = x * 1.702
    return out.sigmoid_().mul_(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "quick_gelu": quick_gelu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError as exc:
        raise ModelLoadError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}") from exc
