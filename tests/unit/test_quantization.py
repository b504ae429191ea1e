"""Quantized weights (`models/quantization.py`, `runner/cpu/quant_gemm.py`, `kernels/quant_gemm.cpp`): codes
round-trip within half a step per format and group size; each kernel's product equals a float64
product of the same quantized weights (and, for w8a8 and w4a8, the same quantized inputs) up to summation
order, for every tile shape; a row's result does not depend on the rows batched with it; the
compiled operator gives the eager numbers; `prepare_for_cpu` moves quantized layers onto the
kernel; an unknown method is refused."""

import pytest
import torch
from torch import nn

from mmserve.config import EngineConfig
from mmserve.errors import ModelLoadError
from mmserve.models.quantization import (
    QuantizedLinear,
    WeightFormat,
    dequantize,
    int4_group_size,
    method_format,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_language_model,
    quantize_rows,
    unpack_int4,
    weight_bytes,
)
from mmserve.runner.cpu import layout, native, quant_gemm


def needs_kernel(test):
    """A test of the built kernels: marked `kernels` (not in the fast tier), skipped where they cannot run
    (decided at setup, not at collection: the condition is a string)."""
    skip = pytest.mark.skipif("quant_gemm.kernel() is None",
                              reason="mmserve's CPU kernels do not run here (no AVX2 or no C++ compiler)")
    return pytest.mark.kernels(skip(test))


METHODS = ("int8", "int4", "w8a8", "w4a8", "int4_weight_only")


def _linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """float64 product of the layer's quantized weights (and quantized inputs for w8a8)."""
    x = x.reshape(-1, layer.in_features)
    if layer.fmt.int8_activations:
        codes, scales = quantize_rows(x)
        x = codes.double() * scales.double()
    out = x.double() @ layer.dequantized_weight().double().t()
    return out if layer.bias is None else out + layer.bias.double()


def test_int4_codes_pack_two_to_a_byte_and_back():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 32) and torch.equal(packed[:, 0] & 0x0F, codes[:, 0])
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_int4_round_trip_is_within_half_a_step(group):
    w = torch.randn(24, 256) * 0.05
    packed, scales, zeros = quantize_int4(w, group)
    assert scales.shape == zeros.shape == (24, 256 // group)
    assert zeros.min() >= 0 and zeros.max() <= 15 and torch.equal(zeros, zeros.round())
    back = dequantize(WeightFormat(4, group), packed, scales, zeros)
    step = scales.repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert (back - w).abs().mean() < 0.3 * step.mean()


def test_int8_round_trip_is_within_half_a_step():
    w = torch.randn(40, 96)
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and scales.shape == (40, 1)
    assert ((dequantize(WeightFormat(8), codes, scales, None) - w).abs() <= scales / 2 + 1e-6).all()


def test_group_size_is_128_or_the_largest_power_of_two_dividing_the_width():
    assert int4_group_size(2048) == 128 and int4_group_size(96) == 32 and int4_group_size(80) == 16
    with pytest.raises(ModelLoadError, match="divisible by 16"):
        int4_group_size(40)
    # int4 is w4a8's recipe (int8 inputs); its weight-only form is asked for by name
    assert method_format("int4", 2048) == method_format("w4a8", 2048) == WeightFormat(4, 128, int8_activations=True)
    assert method_format("int4_weight_only", 2048) == WeightFormat(4, 128)
    assert method_format("int4", 2048, head=True) == WeightFormat(8)  # the head stays int8
    assert method_format("w8a8", 64).int8_activations


@pytest.mark.parametrize("method", METHODS)
def test_reference_product_is_the_float64_product_of_the_codes(method):
    linear = _linear(128, 40)
    layer = QuantizedLinear.from_linear(linear, method_format(method, 128))
    x = torch.randn(7, 128)
    torch.testing.assert_close(layer(x).double(), _reference(layer, x), rtol=1e-5, atol=1e-5)
    # and close to the float layer it came from
    assert (layer(x) - linear(x)).abs().max() < (0.11 if method in ("int4", "w4a8", "int4_weight_only") else 0.03)


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("in_features,out_features,bias", [(64, 48, True), (128, 37, False), (256, 100, True),
                                                          (32, 16, False), (128, 60, True), (256, 200, True)])
def test_kernel_products_are_the_float64_products_of_the_codes(method, in_features, out_features, bias):
    layer = QuantizedLinear.from_linear(_linear(in_features, out_features, bias), method_format(method, in_features))
    panel = quant_gemm.QuantPanelLinear(layer, quant_gemm.kernel())
    torch.testing.assert_close(panel.dequantized_weight(), layer.dequantized_weight(), rtol=1e-6, atol=1e-6)
    # a few rows (panels taken several at once), in-register tiles, and the dequantized-panel path
    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 18, 40):
        x = torch.randn(rows, in_features)
        got = panel(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _reference(layer, x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, in_features, dtype=torch.bfloat16)  # leading dims kept, bfloat16 in and out
    out = panel(x)
    assert out.shape == (2, 3, out_features) and out.dtype == torch.bfloat16


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(method):
    for out_features in (130, 60):  # a partial last panel after whole panels, and in a layer of four panels
        layer = QuantizedLinear.from_linear(_linear(256, out_features, seed=3), method_format(method, 256))
        panel = quant_gemm.QuantPanelLinear(layer, quant_gemm.kernel())
        x = torch.randn(40, 256)
        whole = panel(x)
        for start, stop in ((0, 1), (5, 6), (1, 3), (7, 10), (20, 24), (3, 11), (17, 40), (0, 32)):
            assert torch.equal(panel(x[start:stop]), whole[start:stop])
    strided = torch.randn(10, 300)[:, 7:263]  # row stride 300: read where it lies
    assert torch.equal(panel(strided), panel(strided.contiguous()))


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
def test_compiled_operator_gives_the_eager_numbers(method):
    layer = QuantizedLinear.from_linear(_linear(64, 48), method_format(method, 64))
    panel = quant_gemm.QuantPanelLinear(layer, quant_gemm.kernel())
    x = torch.randn(3, 64)
    compiled = torch.compile(panel, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), panel(x))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.layers = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
        self.language_model.lm_head = nn.Linear(64, 200, bias=False)
        self.visual = nn.Linear(32, 64)


@pytest.mark.kernels  # prepare_for_cpu packs onto the kernel where it runs
@pytest.mark.parametrize("method", METHODS)
def test_only_the_language_models_linears_are_quantized_the_head_in_int8(method):
    model = _Tiny()
    float_bytes = weight_bytes(model)
    assert quantize_language_model(model, method) == 3
    lm = model.language_model
    assert all(isinstance(m, QuantizedLinear) for m in (*lm.layers, lm.lm_head))
    assert lm.lm_head.fmt == WeightFormat(8) and type(model.visual) is nn.Linear
    assert lm.layers[0].fmt == method_format(method, 64)
    assert weight_bytes(model) < 0.5 * float_bytes
    prepared = layout.prepare_for_cpu(model)
    if quant_gemm.kernel() is not None:
        assert prepared.quantized_packed == 3
        assert isinstance(model.language_model.lm_head, quant_gemm.QuantPanelLinear)


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, w8a8, w4a8, int4_weight_only"):
        EngineConfig.from_kwargs("some-dir", quantization="int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        method_format("fp4", 64)


@pytest.fixture(scope="module")
def both_builds(tmp_path_factory):
    """This CPU's build of the kernels and the AVX2 one, built once for the module's tests."""
    compiler, where = native._compiler(), tmp_path_factory.mktemp("quant-builds")
    return (quant_gemm.QuantKernel(native.build(compiler, where, quant_gemm.SOURCE)),
            quant_gemm.QuantKernel(native.build(compiler, where, quant_gemm.SOURCE, native.AVX2_FLAGS)))


@needs_kernel
@pytest.mark.skipif("-mavx512f" not in native.isa_flags(), reason="this CPU has no AVX-512: only the AVX2 build runs")
@pytest.mark.parametrize("method", METHODS)
def test_the_avx512_build_gives_the_avx2_builds_bits(method, both_builds):
    """Where the CPU has AVX-512 the kernels are built with its wider tiles (`native.isa_flags`); each output is
    the same arithmetic on the same codes, so the answer does not depend on the machine's vector width."""
    wide, narrow = both_builds
    assert wide.path != narrow.path
    for in_features, out_features in ((256, 100), (128, 37), (64, 48), (128, 60)):
        layer = QuantizedLinear.from_linear(_linear(in_features, out_features, seed=in_features),
                                            method_format(method, in_features))
        a, b = quant_gemm.QuantPanelLinear(layer, wide), quant_gemm.QuantPanelLinear(layer, narrow)
        for rows in (1, 2, 3, 4, 7, 12, 13, 17, 30, 45):
            x = torch.randn(rows, in_features)
            assert torch.equal(a(x), b(x))
