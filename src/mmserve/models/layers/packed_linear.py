"""Prepacked bfloat16 linear layers on the CPU: the same numbers, fewer cycles.

Role: `prepack_linears(model)` replaces every `nn.Linear` whose weight is bfloat16 on the CPU by a
`PackedLinear` that holds, beside the original weight, a copy reordered once into oneDNN's blocked
layout, and multiplies with it (`torch.ops.mkldnn._linear_pointwise`, on AMX or AVX-512 BF16 units).
`F.linear` on a bfloat16 weight reorders the weight on every call; packed once, a linear is about
1.3-2x faster at a few dozen rows. Both accumulate in float32 and round the result to bfloat16 once;
oneDNN's blocking for the packed weight can sum in another order, so a result may differ from
`F.linear`'s in its last bit (`tests/unit/test_packed_linear.py` bounds both by the rounding of the
exact result). The packed copy doubles the memory of the linear weights.

float32 is left alone on purpose: its outputs must equal transformers' bit for bit, and both packed
routes change them (MKL's packed sgemm runs only at exactly the packed row count and then rounds a
bias add differently; oneDNN's float32 kernels sum in another order than MKL's). At one row they
are slower too.

What it does not know: models, families, devices other than the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16,)
# the row count oneDNN picks its blocking for; any row count works with the packed weight
PACK_ROWS_HINT = 32


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """A linear layer whose weight is also kept in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module) -> int:
    """Swap every bfloat16 CPU `nn.Linear` of `model` for a `PackedLinear`; returns how many."""
    if not packing_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype in PACKED_DTYPES and child.weight.device.type == "cpu"]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
