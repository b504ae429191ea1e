"""mmserve's CPU matmuls on quantized weights: `QuantPanelLinear` over `kernels/quant_gemm.cpp`.

Role: re-store a `models.quantization.QuantizedLinear`'s codes once in the kernel's panel layout
(16 output columns a panel, streamed with the next one prefetched, as `gemm.PanelLinear`'s float32
panels) and run its product: int8 and int4 weight-only on AVX2 (codes widened to float32 in
registers), w8a8 and w4a8 with each input row quantized to int8 and the dot products summed in integers. The panels hold
the codes and scales the checkpoint or the quantizer produced and nothing else (no float copy).
Products are float32 (a bfloat16 input is widened and the result rounded back); a row's result does
not depend on the rows batched with it. Why these kernels and not ATen's `_weight_int8pack_mm` /
`_weight_int4pack_mm_for_cpu`: the README ("Quantized weights") gives the measurements.

Under `torch.compile` the products are the operators `mmserve::quant_linear`, `mmserve::w8a8_linear`
and `mmserve::w4a8_linear` (opaque to the compiler); eager calls go to the library directly.

What it does not know: models, checkpoint formats, the engine.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from mmserve.models.quantization import QuantizedLinear, unpack_int4
from mmserve.runner.cpu.native import KERNELS_DIR, cached_library

SOURCE = KERNELS_DIR / "quant_gemm.cpp"
PANEL_COLUMNS = 16


def _padded_columns(values: torch.Tensor, panels: int) -> torch.Tensor:
    """(N, G) per-column values -> (panels, G, 16) float32, zero past N."""
    n, groups = values.shape
    out = torch.zeros(panels * PANEL_COLUMNS, groups, dtype=torch.float32)
    out[:n] = values.float()
    return out.view(panels, PANEL_COLUMNS, groups).transpose(1, 2).contiguous()


class QuantKernel:
    """The loaded library: packing and the products, on raw pointers (shapes checked by the callers)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.mm_q_panels.argtypes, lib.mm_q_panels.restype = [i64], i64
        lib.mm_q_k4.argtypes, lib.mm_q_k4.restype = [i64], i64
        for name in ("mm_q8_pack", "mm_q4_pack"):
            getattr(lib, name).argtypes, getattr(lib, name).restype = [ptr, ptr, i64, i64], None
        lib.mm_w8a8_pack.argtypes, lib.mm_w8a8_pack.restype = [ptr, ptr, i64, i64], None
        lib.mm_w4a8_pack.argtypes, lib.mm_w4a8_pack.restype = [ptr, ptr, i64, i64], None
        lib.mm_w4a8_gemm.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, c_int]
        lib.mm_w4a8_gemm.restype = None
        lib.mm_q_gemm.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, c_int]
        lib.mm_q_gemm.restype = None
        lib.mm_quantize_rows.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, c_int]
        lib.mm_quantize_rows.restype = None
        lib.mm_w8a8_gemm.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, c_int, c_int]
        lib.mm_w8a8_gemm.restype = None
        self.path = path
        self._lib = lib
        # w8a8 on AMX's int8 tiles where the build has them and Linux grants them (the same sums, exact)
        self.amx = bool(lib.mm_q_amx_init())

    # ---- packing --------------------------------------------------------------------------------
    def _pack(self, function: str, codes: torch.Tensor, panel_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """(N, K) codes -> the panels `function` writes, `panel_bytes(N, K)` bytes of `dtype`."""
        codes = codes.detach().contiguous()
        n, k = codes.shape
        panels = torch.empty(panel_bytes, dtype=dtype)
        getattr(self._lib, function)(codes.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def pack_int8(self, codes: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        return self._pack("mm_q8_pack", codes, self._lib.mm_q_panels(n) * k * PANEL_COLUMNS, torch.int8)

    def pack_int4(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: (N, K) uint8 values 0..15, one per byte."""
        n, k = codes.shape
        return self._pack("mm_q4_pack", codes, self._lib.mm_q_panels(n) * k * 8, torch.uint8)

    def pack_w8a8(self, codes: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        return self._pack("mm_w8a8_pack", codes, self._lib.mm_q_panels(n) * self._lib.mm_q_k4(k) * 64, torch.int8)

    def pack_w4a8(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: (N, K) uint8 values 0..15, one per byte, K a multiple of 8."""
        n, k = codes.shape
        return self._pack("mm_w4a8_pack", codes, self._lib.mm_q_panels(n) * k * 8, torch.uint8)

    # ---- products -------------------------------------------------------------------------------
    def weight_only(self, x: torch.Tensor, bits: int, panels: torch.Tensor, scales: torch.Tensor,
                    offsets: torch.Tensor | None, group: int, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k).float()
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        if rows.shape[0]:
            self._lib.mm_q_gemm(bits, rows.data_ptr(), rows.shape[0], k, rows.stride(0), panels.data_ptr(),
                                out_features, scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                                group, None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                torch.get_num_threads())
        return out.to(x.dtype).view(*x.shape[:-1], out_features)

    def _quantized_rows(self, rows: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, K) float32 rows -> (int8 codes (M, padded), zero past K; scales (M,)), as `quantize_rows`."""
        m, k = rows.shape
        codes = torch.empty(m, padded, dtype=torch.int8)
        row_scales = torch.empty(m, dtype=torch.float32)
        self._lib.mm_quantize_rows(rows.data_ptr(), m, k, k, codes.data_ptr(), padded, row_scales.data_ptr(),
                                   torch.get_num_threads())
        return codes, row_scales

    def w8a8(self, x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
             out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k).float().contiguous()
        m, padded = rows.shape[0], self._lib.mm_q_k4(k) * 4
        out = torch.empty(m, out_features, dtype=torch.float32)
        if m:
            codes, row_scales = self._quantized_rows(rows, padded)
            self._lib.mm_w8a8_gemm(codes.data_ptr(), row_scales.data_ptr(), m, k, padded, panels.data_ptr(),
                                   scales.data_ptr(), out_features, None if bias is None else bias.data_ptr(),
                                   out.data_ptr(), out_features, torch.get_num_threads(), int(self.amx))
        return out.to(x.dtype).view(*x.shape[:-1], out_features)

    def w4a8(self, x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
             bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k).float().contiguous()
        m = rows.shape[0]
        out = torch.empty(m, out_features, dtype=torch.float32)
        if m:
            codes, row_scales = self._quantized_rows(rows, k)
            self._lib.mm_w4a8_gemm(codes.data_ptr(), row_scales.data_ptr(), m, k, k, panels.data_ptr(),
                                   scales.data_ptr(), offsets.data_ptr(), group, out_features,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                   torch.get_num_threads())
        return out.to(x.dtype).view(*x.shape[:-1], out_features)


# the kernel, or None where it cannot run; quantized linears then keep their torch reference product
kernel = cached_library(SOURCE, "quantized linears run in torch (dequantized a chunk at a time)", QuantKernel)


def _lib() -> QuantKernel:
    lib = kernel()
    assert lib is not None, "mmserve's quantized operators run only where the kernel was built"
    return lib


def _quant_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                  bias: torch.Tensor | None, out_features: int, bits: int, group: int) -> torch.Tensor:
    return _lib().weight_only(x, bits, panels, scales, offsets, group, bias, out_features)


def _w8a8_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    return _lib().w8a8(x, panels, scales, bias, out_features)


def _w4a8_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bias: torch.Tensor | None, out_features: int, group: int) -> torch.Tensor:
    return _lib().w4a8(x, panels, scales, offsets, group, bias, out_features)


def _fake(x: torch.Tensor, *args: object) -> torch.Tensor:
    out_features = next(a for a in args if isinstance(a, int))
    return x.new_empty(*x.shape[:-1], out_features)


# as gemm.py's operator: a `torch.library.Library` with CPU kernels (cheaper per call than custom_op)
_LIBRARY = torch.library.Library("mmserve", "FRAGMENT")
_LIBRARY.define("quant_linear(Tensor x, Tensor panels, Tensor scales, Tensor? offsets, Tensor? bias, "
                "int out_features, int bits, int group) -> Tensor")
_LIBRARY.define("w8a8_linear(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.define("w4a8_linear(Tensor x, Tensor panels, Tensor scales, Tensor offsets, Tensor? bias, int out_features, "
                "int group) -> Tensor")
for _name, _impl in (("quant_linear", _quant_linear), ("w8a8_linear", _w8a8_linear), ("w4a8_linear", _w4a8_linear)):
    _LIBRARY.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"mmserve::{_name}", _fake, lib=_LIBRARY)


class QuantPanelLinear(nn.Module):
    """A `QuantizedLinear` on the kernel's panels. `dequantized_weight()` gives the (out, in) float32
    weight the panels stand for, for inspection: the product never calls it."""

    def __init__(self, layer: QuantizedLinear, lib: QuantKernel) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = layer.in_features, layer.out_features, layer.fmt
        count = -(-self.out_features // PANEL_COLUMNS)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float(), requires_grad=False)
        self.group = 0
        self.register_buffer("offsets", None, persistent=False)
        with torch.no_grad():
            if self.fmt.int8_activations and self.fmt.bits == 8:
                panels = lib.pack_w8a8(layer.qweight)
            elif self.fmt.bits == 8:
                panels = lib.pack_int8(layer.qweight)
            else:
                assert layer.zeros is not None
                codes = unpack_int4(layer.qweight)
                panels = lib.pack_w4a8(codes) if self.fmt.int8_activations else lib.pack_int4(codes)
                self.group = self.in_features // layer.scales.shape[1]
                offsets = _padded_columns(-layer.zeros.float() * layer.scales.float(), count)
                self.register_buffer("offsets", offsets, persistent=False)
            self.register_buffer("panels", panels, persistent=False)
            scales = _padded_columns(layer.scales, count)  # (panels, groups, 16)
            self.register_buffer("scales", scales if self.fmt.bits == 4 else scales.reshape(-1), persistent=False)
        self._lib = lib

    def dequantized_weight(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        count = -(-n // PANEL_COLUMNS)
        if self.fmt.int8_activations and self.fmt.bits == 8:
            codes = self.panels.view(count, -1, PANEL_COLUMNS, 4).permute(0, 2, 1, 3).reshape(count * PANEL_COLUMNS, -1)
            return codes[:n, :k].float() * self.scales[:n, None]
        if self.fmt.bits == 8:
            codes = self.panels.view(count, k, PANEL_COLUMNS).permute(0, 2, 1).reshape(-1, k)
            return codes[:n].float() * self.scales[:n, None]
        if self.fmt.int8_activations:  # blocks of 8 inputs: a column's 4 bytes, inputs t and t + 4 in each
            blocks = self.panels.view(count, k // 8, PANEL_COLUMNS, 4)
            codes = torch.cat((blocks & 0x0F, blocks >> 4), dim=3).permute(0, 1, 3, 2).reshape(count, k, PANEL_COLUMNS)
            codes = codes.float()
        else:
            bytes_ = self.panels.view(count, k, 8)
            codes = torch.cat((bytes_ & 0x0F, bytes_ >> 4), dim=2).float()  # (panels, k, 16)
        scales = self.scales.repeat_interleave(self.group, dim=1)  # (panels, k, 16)
        offsets = self.offsets.repeat_interleave(self.group, dim=1)
        return (codes * scales + offsets).permute(0, 2, 1).reshape(-1, k)[:n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the operator, checked first: the profiler check is not traced
            return self._product(x, compiling=True)
        if torch.autograd._profiler_enabled():  # named in a profile as the compiled step's operator is
            name = "w4a8_linear" if self.fmt.int8_activations and self.fmt.bits == 4 else (
                "w8a8_linear" if self.fmt.int8_activations else "quant_linear")
            with torch.profiler.record_function(f"mmserve::{name}"):
                return self._product(x, compiling=False)
        return self._product(x, compiling=False)

    def _product(self, x: torch.Tensor, compiling: bool) -> torch.Tensor:
        if self.fmt.int8_activations and self.fmt.bits == 4:
            if compiling:
                return torch.ops.mmserve.w4a8_linear(x, self.panels, self.scales, self.offsets, self.bias,
                                                     self.out_features, self.group)
            return self._lib.w4a8(x, self.panels, self.scales, self.offsets, self.group, self.bias, self.out_features)
        if self.fmt.int8_activations:
            if compiling:
                return torch.ops.mmserve.w8a8_linear(x, self.panels, self.scales, self.bias, self.out_features)
            return self._lib.w8a8(x, self.panels, self.scales, self.bias, self.out_features)
        if compiling:
            return torch.ops.mmserve.quant_linear(x, self.panels, self.scales, self.offsets, self.bias,
                                                  self.out_features, self.fmt.bits, self.group)
        return self._lib.weight_only(x, self.fmt.bits, self.panels, self.scales, self.offsets, self.group, self.bias,
                                     self.out_features)
