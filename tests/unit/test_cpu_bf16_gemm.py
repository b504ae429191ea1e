"""mmserve's bfloat16 CPU matmul on AMX tiles (`runner/cpu/bf16_gemm.py`, `runner/cpu/kernels/bf16_gemm.cpp`):
a bfloat16 gemm's contract (bfloat16 operands, float32 sums, one rounding) for every shape the kernel
blocks (row blocks of 16 and 32, chunks of 256 rows, odd panels, widths that are not whole tiles, bias or
none, strided rows), each row's result independent of the rows batched with it, the dense weight read
back exactly, the compiled operator equal to eager, and the layer's place in `layout.prepare_for_cpu`.
Runs where the CPU has AMX's bfloat16 tiles (elsewhere the language model keeps oneDNN's linear)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.runner.cpu import bf16_gemm

# builds the kernel (at setup, not at collection: the condition is a string): not in the fast tier
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif("bf16_gemm.kernel() is None",
                                 reason="no AMX bfloat16 tiles here (or no compiler): oneDNN's linear runs instead")]


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


def _reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """The float64 product of the same bfloat16 operands (and the bias as the kernel holds it: float32)."""
    out = x.double() @ linear.weight.double().t()
    if linear.bias is not None:
        out = out + linear.bias.float().double()
    return out


@pytest.mark.parametrize("in_features,out_features", [(64, 48), (37, 100), (640, 16), (5, 3), (96, 1000), (201, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_products_are_bfloat16_gemms(in_features, out_features, bias):
    linear = _linear(in_features, out_features, bias)
    layer = bf16_gemm.BFloat16PanelLinear(linear, bf16_gemm.kernel())
    assert torch.equal(layer.weight, linear.weight)  # the dense weight reads back exactly
    for rows in (0, 1, 2, 15, 16, 17, 31, 32, 33, 70, 300):
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        got = layer(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        expected = _reference(x, linear)
        # float32 sums of exact products, rounded once: within a bfloat16 rounding of the exact value
        # (plus float32 summation error), never further
        tolerance = expected.abs() * 2.0 ** -8 + 1e-3
        assert ((got.double() - expected).abs() <= tolerance).all()
        torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1.6e-2, atol=1e-2)
    x = torch.randn(2, 3, in_features).to(torch.bfloat16)  # leading dims are kept
    assert layer(x).shape == (2, 3, out_features)


def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it():
    linear = _linear(200, 130, bias=True, seed=3)
    layer = bf16_gemm.BFloat16PanelLinear(linear, bf16_gemm.kernel())
    x = torch.randn(600, 200).to(torch.bfloat16)
    whole = layer(x)
    for start, stop in ((0, 1), (5, 6), (3, 11), (17, 40), (0, 32), (250, 270), (599, 600)):
        assert torch.equal(layer(x[start:stop]), whole[start:stop])


def test_strided_rows_are_read_where_they_lie():
    linear = _linear(48, 40, bias=True)
    layer = bf16_gemm.BFloat16PanelLinear(linear, bf16_gemm.kernel())
    wide = torch.randn(10, 100).to(torch.bfloat16)
    rows = wide[:, 7:55]  # row stride 100, not 48
    assert torch.equal(layer(rows), layer(rows.contiguous()))
    tiles = torch.randn(20, 64).to(torch.bfloat16)[:, :32]  # a whole tile's width, row stride 64
    layer = bf16_gemm.BFloat16PanelLinear(_linear(32, 24, bias=False), bf16_gemm.kernel())
    assert torch.equal(layer(tiles), layer(tiles.contiguous()))


def test_compiled_products_are_the_eager_ones():
    layer = bf16_gemm.BFloat16PanelLinear(_linear(80, 72, bias=True, seed=1), bf16_gemm.kernel())
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(layer(x)) + 1, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows in (3, 17):
            x = torch.randn(rows, 80).to(torch.bfloat16)
            assert torch.equal(compiled(x), torch.relu(layer(x)) + 1)


def test_float32_inputs_are_refused():
    layer = bf16_gemm.BFloat16PanelLinear(_linear(8, 8, bias=False), bf16_gemm.kernel())
    with pytest.raises(TypeError, match="bfloat16 inputs"):
        layer(torch.randn(2, 8))
