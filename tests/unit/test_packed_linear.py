"""Prepacked bfloat16 linears (`models/layers/packed_linear.py`) round the exact result as `F.linear`
does (both within bfloat16's rounding of the float32-accumulated product, for every row count, with
and without a bias), and leave float32 layers alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmserve.models.layers.packed_linear import PackedLinear, packing_available, prepack_linears

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear")
BF16_ROUNDING = 2.0 ** -8  # half an ulp of bfloat16's 8-bit significand, relative


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(384, 1152), (1024, 384), (1176, 256), (120, 397)])
def test_packed_rounds_the_exact_product(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (1, 3, 16, 32, 33, 64, 100, 257):
        x = torch.randn(rows, shape[0]).to(torch.bfloat16)
        exact = nn.functional.linear(x.double(), linear.weight.double(),
                                     None if linear.bias is None else linear.bias.double())
        bound = BF16_ROUNDING * exact.abs() + 1e-3 * exact.abs().max()  # + float32 summation-order slack
        for got in (packed(x), linear(x)):
            assert ((got.double() - exact).abs() <= bound).all(), rows
    x3 = torch.randn(2, 5, shape[0]).to(torch.bfloat16)
    assert torch.equal(packed(x3), packed(x3.reshape(10, -1)).view(2, 5, -1))


def test_prepack_swaps_only_bfloat16_cpu_linears():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.LayerNorm(4))
    assert prepack_linears(model) == 0  # float32 stays on MKL: its outputs must equal transformers'
    model = model.to(torch.bfloat16)
    x = torch.randn(3, 8).to(torch.bfloat16)
    before = model(x)
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    torch.testing.assert_close(model(x), before)
    assert {n for n, _ in model.named_parameters()} == {"0.weight", "0.bias", "1.0.weight", "1.0.bias",
                                                         "2.weight", "2.bias"}
