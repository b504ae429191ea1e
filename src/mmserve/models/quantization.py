"""Quantized weights of the language model's linear layers: the formats, quantizing at load, the reference product.

Role: what a quantized linear stores and what it means, whatever kernel multiplies by it.
- `int8`: weight-only, one float32 scale per output channel, symmetric: w = q * s, q in -127..127.
- `int4_weight_only`: group-wise along the input: per group of `INT4_GROUP_SIZE` inputs (a smaller
  power of two where the width is not a multiple of it) and output channel a scale and a zero point,
  w = (q - z) * s with q in 0..15: the layout AWQ and GPTQ checkpoints hold, so that one kernel
  serves weights quantized here and weights loaded pre-quantized. Quantized here, the zero point is
  the one min/max rounding gives (asymmetric); a symmetric checkpoint has z = 8.
- `w8a8`: `int8`'s weights with each input row quantized at run time to int8 (max|x| / 127, round to
  nearest even), the product summed in integers: for the CPU's VNNI/AMX and GPUs' int8 paths.
- `w4a8`, and `int4` (its recipe by default): `int4_weight_only`'s weights with `w8a8`'s int8 input
  rows, each group's products summed in integers (as llama.cpp's 4-bit files multiply theirs): a 4-bit
  decode bound by bytes rather than by widening codes to floats (measured faster to decode and to
  prefill at the same accuracy, so `int4` means it).
What is quantized and why: the linears of the language model's decoder layers, which are what a
decode step streams from memory; the untied LM head in `int8` weight-only for every method (its
logits are what sampling and logprobs read; llama.cpp's 4-bit files keep their output tensor wider
too). Embeddings (one row read per token), norms and the vision tower (one long product per image,
compute- not bandwidth-bound) stay in the model dtype.

`QuantizedLinear.forward` is the reference, in torch, that runs everywhere: the weight dequantized a
few MiB of rows at a time (no full-precision copy is kept). The CPU's kernels (`runner/cpu/quant_gemm.py`)
replace it after loading with panels of the same values; the step does not know which it calls.

What it does not know: checkpoint files and their formats (`prequantized.py`), kernels, the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.config import QUANTIZATION_METHODS
from mmserve.errors import ModelLoadError

INT4_GROUP_SIZE = 128  # inputs per int4 scale: the group AWQ/GPTQ checkpoints and torchao default to
MIN_INT4_GROUP_SIZE = 16
DEQUANT_CHUNK_BYTES = 4 << 20  # float rows dequantized per product in the reference path
HEAD_NAME = "lm_head"


@dataclass(frozen=True)
class WeightFormat:
    """How one quantized linear stores its weight."""

    bits: int  # 8: int8 codes; 4: codes 0..15 two to a byte (the even input in the low nibble)
    group_size: int | None = None  # inputs per scale; None: one scale per output channel
    int8_activations: bool = False  # w8a8 / w4a8: inputs quantized per row at run time

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.bits == 4 and not self.group_size:
            raise ValueError("int4 weights need a group size")
        if self.int8_activations and self.bits == 4 and self.group_size % 8:
            raise ValueError("int8 activations with int4 weights need groups of a multiple of 8 inputs")

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size


def int4_group_size(in_features: int, preferred: int = INT4_GROUP_SIZE) -> int:
    """`preferred`, or the largest smaller power of two (down to MIN_INT4_GROUP_SIZE) dividing the width."""
    group = preferred
    while group >= MIN_INT4_GROUP_SIZE:
        if in_features % group == 0:
            return group
        group //= 2
    raise ModelLoadError(f"int4 needs an input width divisible by {MIN_INT4_GROUP_SIZE}; got {in_features}")


def method_format(method: str, in_features: int, head: bool = False) -> WeightFormat:
    """The format `method` gives a linear of `in_features` inputs (the LM head: int8 weight-only)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None; got {method!r}")
    if head or method == "int8":
        return WeightFormat(8)
    if method == "w8a8":
        return WeightFormat(8, int8_activations=True)
    # "int4" and "w4a8": int8 inputs; "int4_weight_only": float inputs
    return WeightFormat(4, int4_group_size(in_features), int8_activations=method != "int4_weight_only")


# ---- codes <-> floats ----------------------------------------------------------------------------

def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) uint8, input 2i in the low nibble of byte i."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K / 2) uint8 -> (N, K) uint8 values 0..15."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (codes int8 (N, K), scales float32 (N, 1)), symmetric per output channel."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scales).clamp_(-127, 127).to(torch.int8), scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (packed codes (N, K / 2) uint8, scales (N, G), zero points (N, G)) float32:
    per group, s = (max - min) / 15 over the range widened to hold 0, z = round(-min / s)."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    low = groups.amin(dim=2).clamp(max=0.0)
    high = groups.amax(dim=2).clamp(min=0.0)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = torch.round(-low / scales).clamp_(0, 15)
    codes = torch.round(groups / scales[..., None] + zeros[..., None]).clamp_(0, 15).reshape(n, k)
    return pack_int4(codes), scales, zeros


def dequantize(fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight (rows of qweight) the codes stand for."""
    if fmt.bits == 8:
        return qweight.float() * scales.float()
    codes = unpack_int4(qweight).float()
    n, k = codes.shape
    group = k // scales.shape[1]
    assert zeros is not None
    w = (codes.view(n, -1, group) - zeros.float()[..., None]) * scales.float()[..., None]
    return w.view(n, k)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (codes int8 (M, K), scales float32 (M, 1)): w8a8's run-time input quantization."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scales).clamp_(-127, 127).to(torch.int8), scales


# ---- the layer -----------------------------------------------------------------------------------

def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """A linear layer on quantized weights: `qweight` (codes, see `WeightFormat`), `scales` and, for
    4 bits, `zeros` (N, groups) float32; `bias` in the model dtype. All are parameters, so a
    checkpoint's tensors load into them as into any other (stacked q/k/v along dim 0 included)."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if fmt.bits == 4 and in_features % (fmt.group_size or 1):
            raise ModelLoadError(f"int4 group size {fmt.group_size} does not divide the input width {in_features}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        groups = fmt.num_groups(in_features)
        if fmt.bits == 8:
            self.qweight = _frozen(torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        else:
            self.qweight = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.scales = _frozen(torch.ones(out_features, groups, dtype=torch.float32, device=device))
        self.zeros = _frozen(torch.zeros(out_features, groups, device=device)) if fmt.bits == 4 else None
        self.bias = _frozen(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: WeightFormat) -> QuantizedLinear:
        """Quantize a loaded float linear."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, fmt, linear.bias is not None, weight.dtype,
                    weight.device)
        with torch.no_grad():
            if fmt.bits == 8:
                codes, scales = quantize_int8(weight)
            else:
                codes, scales, zeros = quantize_int4(weight, fmt.group_size or linear.in_features)
                layer.zeros.copy_(zeros)
            layer.qweight.copy_(codes)
            layer.scales.copy_(scales)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def dequantized_weight(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the float32 weight (for the reference product and inspection)."""
        stop = self.out_features if stop is None else stop
        zeros = None if self.zeros is None else self.zeros[start:stop]
        return dequantize(self.fmt, self.qweight[start:stop], self.scales[start:stop], zeros)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.fmt.int8_activations:
            codes, row_scales = quantize_rows(rows)
            rows = codes.float() * row_scales  # the quantized inputs, exactly
        rows = rows.float()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        chunk = max(1, DEQUANT_CHUNK_BYTES // (4 * max(self.in_features, 1)))
        for start in range(0, self.out_features, chunk):
            stop = min(start + chunk, self.out_features)
            out[:, start:stop] = rows @ self.dequantized_weight(start, stop).t()
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.fmt.group_size}" if self.fmt.group_size else ""
        act = ", int8 activations" if self.fmt.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.fmt.bits}{group}{act}"


def language_model_linears(model: nn.Module) -> Iterable[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain `nn.Linear` under `model.language_model`."""
    language_model = getattr(model, "language_model", None)
    if language_model is None:
        return []
    found = []
    for parent in language_model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, name, child))
    return found


def quantize_language_model(model: nn.Module, method: str) -> int:
    """Replace the language model's float linears by `QuantizedLinear`s of `method` (see the module
    docstring). Returns how many were replaced."""
    count = 0
    head = getattr(getattr(model, "language_model", None), HEAD_NAME, None)
    for parent, name, linear in language_model_linears(model):
        fmt = method_format(method, linear.in_features, head=linear is head)
        setattr(parent, name, QuantizedLinear.from_linear(linear, fmt))
        count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (each storage once: a tied head counts once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total

