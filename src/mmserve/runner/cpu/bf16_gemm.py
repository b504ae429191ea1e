"""mmserve's own bfloat16 CPU matmul for the language model: `BFloat16PanelLinear` over
`kernels/bf16_gemm.cpp`, on AMX tiles.

Role: load the kernel (built and cached by `native`; used only where the CPU has AMX's bfloat16 tiles
and Linux grants them to the process) and run bfloat16 linear layers on weights re-stored once in
its panel layout: 16 output columns a panel with the inputs in pairs, each panel's 16 pairs one AMX
tile (`kernels/bf16_gemm.cpp` says why). A product is a bfloat16 gemm's contract (bfloat16 operands,
float32 sums, one rounding to bfloat16), with every output summed in the same order whatever the
rows batched with it; it differs from oneDNN's in the last bits (another summation order). The
measurements behind it are in the README ("Speed on CPUs").

Under `torch.compile` the product is the operator `mmserve::bf16_panel_linear` (opaque to the
compiler); eager calls go to the library directly.

What it does not know: models, the engine, other dtypes or devices (`layout` hands it bfloat16 CPU
layers only).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from mmserve.runner.cpu.gemm import define_panel_op, panel_forward
from mmserve.runner.cpu.native import KERNELS_DIR, cached_library

SOURCE = KERNELS_DIR / "bf16_gemm.cpp"


class BFloat16Kernel:
    """The loaded library: packing and the product, on raw pointers (shapes checked by the callers)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.mm_bf16_panel_elements.argtypes, lib.mm_bf16_panel_elements.restype = [i64, i64], i64
        lib.mm_bf16_pack_panels.argtypes, lib.mm_bf16_pack_panels.restype = [ptr, ptr, i64, i64], None
        lib.mm_bf16_unpack_panels.argtypes, lib.mm_bf16_unpack_panels.restype = [ptr, ptr, i64, i64, i64], None
        lib.mm_bf16_panel_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
        lib.mm_bf16_panel_gemm.restype = None
        self.path = path
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(N, K) bfloat16 -> the panels, a flat bfloat16 tensor."""
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"the bfloat16 kernel packs bfloat16 weights, got {weight.dtype}")
        weight = weight.detach().contiguous()
        n, k = weight.shape
        panels = torch.empty(self._lib.mm_bf16_panel_elements(n, k), dtype=torch.bfloat16)
        self._lib.mm_bf16_pack_panels(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def unpack(self, panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The panels -> the dense (N, K) bfloat16 weight they hold."""
        weight = torch.empty(out_features, in_features, dtype=torch.bfloat16)
        self._lib.mm_bf16_unpack_panels(panels.data_ptr(), weight.data_ptr(), 0, out_features, in_features)
        return weight

    def linear(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """x (..., K) bfloat16 -> (..., out_features) bfloat16; `bias` float32 or None."""
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if rows.shape[0]:
            self._lib.mm_bf16_panel_gemm(rows.data_ptr(), rows.shape[0], k, rows.stride(0), panels.data_ptr(),
                                         out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                                         out_features, torch.get_num_threads())
        return out.view(*x.shape[:-1], out_features)


def _load(path: Path) -> BFloat16Kernel | None:
    lib = ctypes.CDLL(str(path))
    if not lib.mm_bf16_available() or not lib.mm_bf16_amx_init():  # no AMX in the build, or not granted
        return None
    return BFloat16Kernel(lib, path)


# the kernel, or None where it cannot run (no AMX, not granted, no build); callers then keep oneDNN's linear
kernel = cached_library(SOURCE, "the language model's bfloat16 linears stay on oneDNN", _load)


_LIBRARY = define_panel_op("bf16_panel_linear", kernel)  # the product as an operator, for compiled steps


class BFloat16PanelLinear(nn.Module):
    """A bfloat16 CPU linear layer on mmserve's AMX kernel. `weight` gives a dense (out, in) copy, for
    inspection only: the product never reads it. The bias is kept in float32, as the kernel adds it
    before its one rounding."""

    def __init__(self, linear: nn.Linear, lib: BFloat16Kernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("panels", lib.pack(linear.weight), persistent=False)
            bias = None if linear.bias is None else linear.bias.detach().float()
            self.register_buffer("bias", bias, persistent=False)
        self._lib = lib

    @property
    def weight(self) -> torch.Tensor:
        return self._lib.unpack(self.panels, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"BFloat16PanelLinear takes bfloat16 inputs, got {x.dtype}")
        return panel_forward("bf16_panel_linear", self._lib, x, self.panels, self.bias, self.out_features)
