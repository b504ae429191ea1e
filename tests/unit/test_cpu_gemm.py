"""mmserve's float32 CPU matmul (`runner/cpu/gemm.py`, `runner/cpu/kernels/panel_gemm.cpp`): the products of
`F.linear` for every shape the kernel tiles (row and column remainders, bias or none, strided rows,
no rows), each row's result independent of the rows batched with it, the same numbers compiled as
eager, and the fallback to oneDNN where the kernel cannot be built (`runner/cpu/native.py`: one build
per source and flags, one switch for every native kernel)."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmserve import envs
from mmserve.runner.cpu import attention as cpu_attention
from mmserve.runner.cpu import gemm as cpu_gemm
from mmserve.runner.cpu import native

# builds the kernels (at setup, not at collection: the condition is a string): not in the fast tier
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif("not cpu_gemm.available()",
                                 reason="mmserve's CPU kernel does not run here (no AVX2 or no C++ compiler)")]


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
    compiler = native._compiler()
    first = native.build(compiler, tmp_path, cpu_gemm.SOURCE)
    stamp = first.stat().st_mtime_ns
    assert native.build(compiler, tmp_path, cpu_gemm.SOURCE) == first and first.stat().st_mtime_ns == stamp  # reused
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DMMSERVE_TEST_FLAG"))
    other = native.build(compiler, tmp_path, cpu_gemm.SOURCE)
    assert other != first and other.exists()
    lib = cpu_gemm.PanelKernel(other)
    linear = _linear(24, 20, bias=False)
    x = torch.randn(4, 24)
    torch.testing.assert_close(lib.linear(x, lib.pack(linear.weight), None, 20), linear(x), rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh_kernel():
    """`cpu_gemm.kernel()` and `cpu_attention.kernel()` decided anew for the test, and again after it."""
    cpu_gemm.kernel.cache_clear()
    cpu_attention.kernel.cache_clear()
    yield
    cpu_gemm.kernel.cache_clear()
    cpu_attention.kernel.cache_clear()


def test_switched_off_or_unbuildable_means_onednn(fresh_kernel, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(envs.NATIVE_KERNELS, "0")
    assert cpu_gemm.kernel() is None
    assert cpu_attention.kernel() is None  # one switch for every native kernel
    cpu_gemm.kernel.cache_clear()
    monkeypatch.delenv(envs.NATIVE_KERNELS)
    monkeypatch.setenv(envs.NATIVE_KERNELS_EARLIER_NAME, "0")  # the switch's earlier name
    assert cpu_gemm.kernel() is None
    cpu_gemm.kernel.cache_clear()
    monkeypatch.delenv(envs.NATIVE_KERNELS_EARLIER_NAME)
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(envs.CXX, "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert cpu_gemm.kernel() is None
    assert "stay on oneDNN" in caplog.text
    cpu_gemm.kernel.cache_clear()
    monkeypatch.setenv(envs.CXX, "no-such-compiler-here")
    assert cpu_gemm.kernel() is None
    from mmserve.runner.cpu.layout import PackedLinear, onednn_linear_available, pack_language_model

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


@pytest.mark.skipif("-mavx512f" not in native.isa_flags(), reason="this CPU has no AVX-512: only the AVX2 build runs")
def test_the_avx512_build_gives_the_avx2_builds_bits(tmp_path):
    """Where the CPU has AVX-512 the kernel is built with its wider tiles (`native.isa_flags`); each output
    is the same chain of fused multiply-adds, so the answer does not depend on the machine's vector width."""
    compiler = native._compiler()
    wide = cpu_gemm.PanelKernel(native.build(compiler, tmp_path, cpu_gemm.SOURCE))
    narrow = cpu_gemm.PanelKernel(native.build(compiler, tmp_path, cpu_gemm.SOURCE, native.AVX2_FLAGS))
    assert wide.path != narrow.path
    for in_features, out_features in ((64, 48), (37, 100), (200, 130), (96, 1000), (5, 3)):
        linear = _linear(in_features, out_features, bias=True, seed=in_features)
        for rows in (1, 3, 7, 12, 13, 17, 32, 45):
            x = torch.randn(rows, in_features)
            for bias in (linear.bias, None):
                assert torch.equal(wide.linear(x, wide.pack(linear.weight), bias, out_features),
                                   narrow.linear(x, narrow.pack(linear.weight), bias, out_features))
