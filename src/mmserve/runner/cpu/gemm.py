"""mmserve's own float32 CPU matmul for the language model: `PanelLinear` over `kernels/panel_gemm.cpp`.

Role: load the kernel (built and cached by `native`) and run linear layers on weights re-stored once
in its panel layout: 16 output columns a panel, streamed from memory once per product with the next
panel prefetched, a 6-row tile's sums kept in registers over the whole input width
(`kernels/panel_gemm.cpp` says why that layout). Every output is summed in the same order whatever
the rows batched with it, so a row's product does not depend on its batch; products differ from
`F.linear`'s in the last bits (another summation order). The measurements behind it are in the README
("Speed on CPUs") and `benchmarks/engine/step_profile.py`.

Under `torch.compile` the product is the operator `mmserve::panel_linear` (opaque to the compiler);
eager calls go to the library directly.

What it does not know: models, the engine, other dtypes or devices (`layout` hands it float32 CPU
layers only; `available()` says whether this machine can run it at all).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmserve.runner.cpu.native import KERNELS_DIR, cached_library

SOURCE = KERNELS_DIR / "panel_gemm.cpp"
PANEL_COLUMNS = 16  # output columns per panel: kernels/panel_gemm.cpp's kCols


class PanelKernel:
    """The loaded library: packing and the product, on raw pointers (shapes checked by the callers)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.mm_panel_floats.argtypes, lib.mm_panel_floats.restype = [i64, i64], i64
        lib.mm_pack_panels.argtypes, lib.mm_pack_panels.restype = [ptr, ptr, i64, i64], None
        lib.mm_panel_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
        lib.mm_panel_gemm.restype = None
        self.path = path
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(N, K) float32 -> the panels, a flat float32 tensor."""
        if weight.dtype != torch.float32:
            raise TypeError(f"the float32 panel kernel packs float32 weights, got {weight.dtype}")
        weight = weight.detach().contiguous()
        n, k = weight.shape
        panels = torch.empty(self._lib.mm_panel_floats(n, k), dtype=torch.float32)
        self._lib.mm_pack_panels(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def linear(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        if rows.shape[0]:
            self._lib.mm_panel_gemm(rows.data_ptr(), rows.shape[0], k, rows.stride(0), panels.data_ptr(), out_features,
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                    torch.get_num_threads())
        return out.view(*x.shape[:-1], out_features)


# the kernel, or None where it cannot run; callers then keep oneDNN's linear
kernel = cached_library(SOURCE, "the language model's float32 linears stay on oneDNN", PanelKernel)


def available() -> bool:
    return kernel() is not None


def _panel_linear_fake(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                       out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def define_panel_op(name: str, loaded: Callable[[], Any]) -> torch.library.Library:
    """The product of a panel kernel (`loaded()`, with `linear(x, panels, bias, out_features)`) as the
    operator `mmserve::<name>`, for compiled steps. Defined on a `torch.library.Library` with a CPU kernel
    rather than with `torch.library.custom_op`, whose Python wrapper costs more per call (a decode step
    makes one call per linear layer); the caller keeps the library as long as its module lives."""
    def product(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        lib = loaded()
        assert lib is not None, f"mmserve::{name} runs only where its kernel was built"
        return lib.linear(x, panels, bias, out_features)

    library = torch.library.Library("mmserve", "FRAGMENT")
    library.define(f"{name}(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor")
    library.impl(name, product, "CPU")
    torch.library.register_fake(f"mmserve::{name}", _panel_linear_fake, lib=library)
    return library


def panel_forward(name: str, lib: Any, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """A panel layer's forward: the operator `mmserve::<name>` under `torch.compile`, else the library
    directly (named in a profile as the operator is; no cost otherwise)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.mmserve, name)(x, panels, bias, out_features)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"mmserve::{name}"):
            return lib.linear(x, panels, bias, out_features)
    return lib.linear(x, panels, bias, out_features)


_LIBRARY = define_panel_op("panel_linear", kernel)


class PanelLinear(nn.Module):
    """A float32 CPU linear layer on mmserve's panel kernel. `weight` gives a dense (out, in) copy, for
    inspection only: the product never reads it."""

    def __init__(self, linear: nn.Linear, lib: PanelKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("panels", lib.pack(linear.weight), persistent=False)
        self.bias = linear.bias
        self._lib = lib

    @property
    def weight(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        return self.panels.view(-1, k, PANEL_COLUMNS).permute(0, 2, 1).reshape(-1, k)[:n].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return panel_forward("panel_linear", self._lib, x, self.panels, self.bias, self.out_features)
