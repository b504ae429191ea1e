"""mmserve's float32 CPU matmul (`runner/cpu_gemm.py`, `runner/kernels/panel_gemm.cpp`): the products of
`F.linear` for every shape the kernel tiles (row and column remainders, bias or none, strided rows,
no rows), each row's result independent of the rows batched with it, the same numbers compiled as
eager, and the fallback to oneDNN where the kernel cannot be built."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.runner import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(),
                                reason="mmserve's CPU kernel does not run here (no AVX2 or no C++ compiler)")


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("in_features,out_features", [(64, 48), (37, 100), (640, 16), (5, 3), (96, 1000)])
@pytest.mark.parametrize("bias", [True, False])
def test_products_are_f_linears(in_features, out_features, bias):
    linear = _linear(in_features, out_features, bias)
    panel = cpu_gemm.PanelLinear(linear, cpu_gemm.kernel())
    for rows in (0, 1, 2, 3, 5, 6, 7, 8, 9, 13, 32, 101):
        x = torch.randn(rows, in_features)
        got = panel(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, in_features)  # leading dims are kept
    torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(panel.weight, linear.weight)  # the dense weight reads back exactly


def test_strided_rows_are_read_where_they_lie():
    linear = _linear(48, 40, bias=True)
    panel = cpu_gemm.PanelLinear(linear, cpu_gemm.kernel())
    wide = torch.randn(10, 100)
    rows = wide[:, 7:55]  # row stride 100, not 48
    expected = panel(rows.contiguous())
    assert torch.equal(panel(rows), expected)
    every_other = torch.randn(10, 96)[:, ::2]  # column stride 2: copied first
    assert torch.equal(panel(every_other), panel(every_other.contiguous()))


def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it():
    linear = _linear(200, 130, bias=True, seed=3)
    panel = cpu_gemm.PanelLinear(linear, cpu_gemm.kernel())
    x = torch.randn(40, 200)
    whole = panel(x)
    for start, stop in ((0, 1), (5, 6), (3, 11), (17, 40), (0, 32)):
        assert torch.equal(panel(x[start:stop]), whole[start:stop])


def test_compiled_products_are_the_eager_ones():
    linear = _linear(80, 72, bias=True, seed=1)
    panel = cpu_gemm.PanelLinear(linear, cpu_gemm.kernel())
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(panel(x)) + 1, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows in (3, 17):
            x = torch.randn(rows, 80)
            assert torch.equal(compiled(x), torch.relu(panel(x)) + 1)


def test_a_build_reuses_the_cached_library_and_keys_it_by_source_and_flags(tmp_path, monkeypatch):
    compiler = cpu_gemm._compiler()
    first = cpu_gemm.build(compiler, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_gemm.build(compiler, tmp_path) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setattr(cpu_gemm, "FLAGS", (*cpu_gemm.FLAGS, "-DMMSERVE_TEST_FLAG"))
    other = cpu_gemm.build(compiler, tmp_path)
    assert other != first and other.exists()
    lib = cpu_gemm.PanelKernel(other)
    linear = _linear(24, 20, bias=False)
    x = torch.randn(4, 24)
    torch.testing.assert_close(lib.linear(x, lib.pack(linear.weight), None, 20), linear(x), rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh_kernel():
    """`cpu_gemm.kernel()` decided anew for the test, and again after it."""
    cpu_gemm.kernel.cache_clear()
    yield
    cpu_gemm.kernel.cache_clear()


def test_switched_off_or_unbuildable_means_onednn(fresh_kernel, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "0")
    assert cpu_gemm.kernel() is None
    cpu_gemm.kernel.cache_clear()
    monkeypatch.delenv(cpu_gemm.DISABLE_ENV)
    monkeypatch.setenv(cpu_gemm.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
        assert cpu_gemm.kernel() is None
    assert "stay on oneDNN" in caplog.text
    cpu_gemm.kernel.cache_clear()
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert cpu_gemm.kernel() is None
    from mmserve.runner.cpu_layout import PackedLinear, onednn_linear_available, pack_language_model

    model = nn.Sequential(_linear(16, 8, bias=True))
    assert pack_language_model(model) == (1 if onednn_linear_available() else 0)
    assert type(model[0]) is (PackedLinear if onednn_linear_available() else nn.Linear)


def test_a_profile_names_the_eager_product():
    """Eager calls go to the library directly, not through the operator: a profile still names them."""
    from torch.profiler import ProfilerActivity, profile

    panel = cpu_gemm.PanelLinear(_linear(32, 24, bias=True), cpu_gemm.kernel())
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        panel(torch.randn(3, 32))
    assert [e.count for e in prof.key_averages() if e.key == "mmserve::panel_linear"] == [1]
