"""Weight layouts and matmul paths that suit the CPU's kernels, chosen once after loading.

Role: how linear layers run on the CPU; the modules' math is unchanged (products differ from
`F.linear`'s in the last bits: another summation order).
- float32, the language model (`pack_language_model`): mmserve's own kernel (`gemm.PanelLinear`)
  wherever it can be built; else oneDNN's linear on weights reordered once into its blocked layout.
  `F.linear` hands the weight to MKL's sgemm, which repacks it on every call, and at decode batch
  sizes that repacking is most of the product. The vision tower is left on MKL: its products are long
  (one row per patch), where packing is slower.
- float32 without oneDNN (`relayout_for_cpu`): `F.linear(x, W)` with W stored (out, in) takes a slow
  path at small batch; the same product with W's storage transposed (a view of a contiguous (in, out)
  tensor) takes the gemm path.
- bfloat16, the language model, on a CPU with AMX tiles (`pack_bfloat16_language_model`): mmserve's
  own AMX kernel (`bf16_gemm.BFloat16PanelLinear`), on weights re-stored once in tiles, where
  oneDNN's linear reorders a plain bfloat16 weight on every call. The vision tower keeps oneDNN's.
- bfloat16 on a CPU without bfloat16 arithmetic (`upcast_bfloat16_linears`): there PyTorch's bfloat16
  gemm is emulated, several times slower than float32 from a few dozen rows up.
  `BFloat16ViaFloat32Linear` keeps the bfloat16 weights and, for 16 rows or more, multiplies in float32
  a few MiB of weight rows at a time, rounding the result to bfloat16: the contract of a bfloat16 gemm
  (bfloat16 operands, float32 accumulation, bfloat16 result), bitwise equal to
  `F.linear(x.float(), W.float()).to(bfloat16)`. Under 16 rows the weight-bound native kernel stays
  faster and is kept. Applied to the whole model, vision included.
- quantized weights (`pack_quantized_linears`): each `models.quantization.QuantizedLinear` on the
  CPU is re-stored as a `quant_gemm.QuantPanelLinear` where mmserve's kernel builds; else it keeps
  its torch reference product.
Embeddings tied to the head are left as they are (the head then reads the embedding table). What each
path measured is in the README ("Speed on CPUs") and `benchmarks/engine/step_profile.py`.

What it does not know: families, the engine, other devices (it does nothing off the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.quantization import QuantizedLinear
from mmserve.runner.cpu import bf16_gemm, quant_gemm
from mmserve.runner.cpu import gemm as cpu_gemm

MIN_OUT_FEATURES = 0  # every projection: the narrow ones gained too once their weights were cold in cache
MIN_UPCAST_ROWS = 16  # below this many rows the native bfloat16 kernel (weight-bound) is faster
UPCAST_CHUNK_BYTES = 4 << 20  # float32 weight rows converted per product: stays off mmap'd allocations


@dataclass(frozen=True)
class CpuPreparation:
    """What `prepare_for_cpu` changed: counts of layers per change."""

    packed: int = 0
    packed_bfloat16: int = 0
    relaid_out: int = 0
    upcast_bfloat16: int = 0
    quantized_packed: int = 0


def relayout_for_cpu(module: nn.Module, min_out_features: int = MIN_OUT_FEATURES) -> int:
    """Re-store the float32 CPU weights of `module`'s linear layers with at least `min_out_features`
    outputs as transposed views of contiguous (in, out) tensors. Returns how many were re-stored."""
    count = 0
    for layer in module.modules():
        if not isinstance(layer, nn.Linear):
            continue
        weight = layer.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] < min_out_features:
            continue
        if weight.stride() == (1, weight.shape[0]):  # already re-stored (a weight shared with another layer)
            continue
        weight.data = weight.data.t().contiguous().t()
        count += 1
    return count


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """A float32 CPU linear layer whose weight oneDNN holds in its own blocked layout.

    `weight` gives a dense (out, in) copy, for inspection only: the product never reads it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), None)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _replace_linears(module: nn.Module, dtype: torch.dtype, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every plain `nn.Linear` under `module` whose weight is `dtype` on the CPU by `make(it)`.
    Returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == dtype:
            setattr(module, name, make(child))
            count += 1
        else:
            count += _replace_linears(child, dtype, make)
    return count


def pack_language_model(module: nn.Module) -> int:
    """Replace every float32 CPU `nn.Linear` under `module` (the untied LM head included) by a
    `cpu_gemm.PanelLinear` where mmserve's kernel runs, else by a `PackedLinear`. Returns how many were
    replaced (none with neither)."""
    lib = cpu_gemm.kernel()
    if lib is not None:
        return _replace_linears(module, torch.float32, lambda linear: cpu_gemm.PanelLinear(linear, lib))
    return _replace_linears(module, torch.float32, PackedLinear) if onednn_linear_available() else 0


def pack_bfloat16_language_model(module: nn.Module) -> int:
    """Replace every bfloat16 CPU `nn.Linear` under `module` (the untied LM head included) by a
    `bf16_gemm.BFloat16PanelLinear` where mmserve's AMX kernel runs. Returns how many were replaced."""
    lib = bf16_gemm.kernel()
    if lib is None:
        return 0
    return _replace_linears(module, torch.bfloat16, lambda linear: bf16_gemm.BFloat16PanelLinear(linear, lib))


class BFloat16ViaFloat32Linear(nn.Linear):
    """A bfloat16 linear layer that multiplies in float32 when there are enough rows to pay for the
    conversion (see the module docstring); the same parameters, names and state as `nn.Linear`."""

    min_rows: int = MIN_UPCAST_ROWS

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BFloat16ViaFloat32Linear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias  # shared: no copy
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(self.in_features, 1)
        if x.dtype != torch.bfloat16 or rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        return linear_via_float32(x, self.weight, self.bias)


def linear_via_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x.float(), weight.float(), bias.float()).to(x.dtype)`, converting the weight a chunk
    of rows at a time so no full float32 copy is ever made."""
    x32 = x.reshape(-1, weight.shape[1]).float()
    out = torch.empty(x32.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    chunk_rows = max(1, UPCAST_CHUNK_BYTES // (4 * max(weight.shape[1], 1)))
    for start in range(0, weight.shape[0], chunk_rows):
        stop = min(start + chunk_rows, weight.shape[0])
        w32 = weight[start:stop].float()
        if bias is None:
            part = torch.mm(x32, w32.t())
        else:
            part = torch.addmm(bias[start:stop].float(), x32, w32.t())
        out[:, start:stop] = part
    return out.reshape(*x.shape[:-1], weight.shape[0])


def cpu_has_bfloat16_arithmetic() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def upcast_bfloat16_linears(module: nn.Module) -> int:
    """Replace every bfloat16 CPU `nn.Linear` under `module` by a `BFloat16ViaFloat32Linear` sharing its
    parameters. Returns how many were replaced."""
    return _replace_linears(module, torch.bfloat16, BFloat16ViaFloat32Linear.from_linear)


def pack_quantized_linears(module: nn.Module) -> int:
    """Replace every CPU `QuantizedLinear` under `module` by a `quant_gemm.QuantPanelLinear` where
    mmserve's kernel runs. Returns how many were replaced."""
    lib = quant_gemm.kernel()
    if lib is None:
        return 0
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, QuantizedLinear) and child.qweight.device.type == "cpu":
            setattr(module, name, quant_gemm.QuantPanelLinear(child, lib))
            count += 1
        else:
            count += pack_quantized_linears(child)
    return count


def prepare_for_cpu(model: nn.Module) -> CpuPreparation:
    """The one call after loading (the engine's model, or an encoder worker's without its language
    model): the changes above that apply to this model and CPU. The vision side gets the same
    bfloat16 path wherever it runs, so its outputs do not depend on where the encoder runs."""
    language_model = getattr(model, "language_model", None)
    packed = pack_language_model(language_model) if language_model is not None else 0
    quantized = pack_quantized_linears(language_model) if language_model is not None else 0
    relaid = relayout_for_cpu(language_model) if language_model is not None else 0  # what oneDNN did not take
    if cpu_has_bfloat16_arithmetic():
        packed_bf16 = pack_bfloat16_language_model(language_model) if language_model is not None else 0
        upcast = 0
    else:
        packed_bf16, upcast = 0, upcast_bfloat16_linears(model)
    return CpuPreparation(packed=packed, packed_bfloat16=packed_bf16, relaid_out=relaid, upcast_bfloat16=upcast,
                          quantized_packed=quantized)
