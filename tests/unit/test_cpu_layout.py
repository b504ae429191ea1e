"""The CPU's weight layouts and matmul paths (`runner/cpu/layout.py`): the language model's float32
linear weights in mmserve's panel kernel's layout (`runner/cpu/gemm.py`), else held by oneDNN in its
blocked layout (without either, re-stored as transposed views of contiguous (in, out) tensors), and bfloat16 linear layers that multiply in float32 from 16 rows
up on a CPU without bfloat16 arithmetic — each with the products a user depends on, and each left
out where it does not apply. What an engine does with them: tests/models/test_cpu_layout_engine.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.runner.cpu import bf16_gemm
from mmserve.runner.cpu import gemm as cpu_gemm
from mmserve.runner.cpu import layout as cpu_layout
from mmserve.runner.cpu.layout import (
    BFloat16ViaFloat32Linear,
    PackedLinear,
    pack_language_model,
    prepare_for_cpu,
    relayout_for_cpu,
    upcast_bfloat16_linears,
)


def _stack(dtype=torch.float32, device="cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 4096, bias=False), nn.Linear(4096, 96)).to(dtype=dtype, device=device)


def test_weights_become_transposed_views_and_products_stay_the_same():
    model = _stack()
    x = torch.randn(16, 64)
    before = model(x)
    assert relayout_for_cpu(model) == 2
    assert model[0].weight.shape == (4096, 64) and model[0].weight.stride() == (1, 4096)
    assert model[1].weight.stride() == (1, 96)
    assert torch.equal(model(x), before)  # batch >= 8: the same gemm, bitwise
    assert torch.allclose(model(x[:1]), before[:1], rtol=1e-5, atol=1e-6)  # batch 1: another summation order
    assert relayout_for_cpu(model) == 0  # idempotent


def test_bfloat16_and_other_devices_are_left_alone():
    for model in (_stack(torch.bfloat16), _stack(device="meta")):
        strides = [layer.weight.stride() for layer in model]
        assert relayout_for_cpu(model) == 0
        assert [layer.weight.stride() for layer in model] == strides


@pytest.fixture
def onednn_only(monkeypatch):
    """pack_language_model as on a machine where mmserve's kernel does not run."""
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: None)


class _LM(nn.Module):
    def __init__(self, vocab=3000, hidden=48, tied=False, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, hidden, dtype=dtype)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(hidden, 4 * hidden, dtype=dtype), nn.SiLU(),
                                                   nn.Linear(4 * hidden, hidden, bias=False, dtype=dtype))])
        self.lm_head = None if tied else nn.Linear(hidden, vocab, bias=False, dtype=dtype)


@pytest.mark.parametrize("kernel", [pytest.param("panel", marks=pytest.mark.kernels), "onednn"])
def test_packed_layers_give_the_layers_products_and_the_heads_argmax(kernel, request):
    if kernel == "onednn":
        request.getfixturevalue("onednn_only")
    elif not cpu_gemm.available():
        pytest.skip("mmserve's CPU kernel does not run here (no AVX2 or no C++ compiler)")
    packed_type = cpu_gemm.PanelLinear if kernel == "panel" else PackedLinear
    lm = _LM()
    reference = _LM()
    assert pack_language_model(lm) == 3
    assert isinstance(lm.lm_head, packed_type) and isinstance(lm.layers[0][0], packed_type)
    assert torch.equal(lm.layers[0][0].bias, reference.layers[0][0].bias)  # the bias stays a parameter
    for rows in (0, 1, 2, 8, 32, 200):  # 0: a step that samples nothing
        hidden = torch.randn(rows, 48)
        expected = reference.layers[0](hidden)
        torch.testing.assert_close(lm.layers[0](hidden), expected, rtol=1e-5, atol=1e-4)  # another summation order
        logits, expected_logits = lm.lm_head(expected), reference.lm_head(expected)
        assert logits.shape == expected_logits.shape == (rows, 3000)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-4)
        assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
    assert torch.equal(lm.lm_head.weight, reference.lm_head.weight)  # a dense copy to read back
    assert pack_language_model(lm) == 0  # idempotent


@pytest.mark.kernels  # the packing it checks is the panel kernel's where it runs
def test_tied_bfloat16_and_off_cpu_layers_are_not_packed():
    tied = _LM(tied=True)
    assert pack_language_model(tied) == 2 and tied.lm_head is None  # the embedding table stays the head
    half = _LM(dtype=torch.bfloat16)
    assert pack_language_model(half) == 0 and type(half.lm_head) is nn.Linear
    meta = nn.Sequential(nn.Linear(48, 3000, bias=False, device="meta"))
    assert pack_language_model(meta) == 0 and type(meta[0]) is nn.Linear


def _bf16_linear(in_features=96, out_features=700, bias=True):
    torch.manual_seed(1)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_via_float32_is_a_bfloat16_gemm_with_float32_accumulation(bias, monkeypatch):
    linear = _bf16_linear(bias=bias)
    upcast = BFloat16ViaFloat32Linear.from_linear(linear)
    monkeypatch.setattr(cpu_layout, "UPCAST_CHUNK_BYTES", 96 * 4 * 64)  # 64 weight rows per chunk: 11 chunks
    b32 = None if linear.bias is None else linear.bias.float()
    for shape in ((16, 96), (3, 40, 96), (300, 96)):
        x = torch.randn(shape).to(torch.bfloat16)
        expected = F.linear(x.float(), linear.weight.float(), b32).to(torch.bfloat16)
        got = upcast(x)
        assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 700)
        assert torch.equal(got, expected)
    few = torch.randn(15, 96).to(torch.bfloat16)  # under 16 rows: the native bfloat16 kernel, untouched
    assert torch.equal(upcast(few), linear(few))


def test_upcast_layers_keep_their_parameters_names_and_state():
    model = nn.Sequential(_bf16_linear(), nn.GELU(), nn.Sequential(_bf16_linear(700, 32, bias=False)))
    keys = list(model.state_dict())
    weights = [p for p in model.parameters()]
    assert upcast_bfloat16_linears(model) == 2
    assert isinstance(model[0], BFloat16ViaFloat32Linear) and isinstance(model[2][0], BFloat16ViaFloat32Linear)
    assert isinstance(model[0], nn.Linear)
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), weights))  # shared, not copied
    assert upcast_bfloat16_linears(model) == 0
    assert upcast_bfloat16_linears(nn.Sequential(nn.Linear(4, 4))) == 0  # float32: not this path


@pytest.mark.kernels  # asks whether the AMX kernel runs here
def test_the_upcast_is_only_for_cpus_without_bfloat16_arithmetic(monkeypatch):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = _bf16_linear()
            self.language_model = _LM(dtype=torch.bfloat16)

    monkeypatch.setattr(cpu_layout, "cpu_has_bfloat16_arithmetic", lambda: True)
    native = prepare_for_cpu(Model())
    assert native.upcast_bfloat16 == 0 and native.packed == 0
    assert native.packed_bfloat16 == (3 if bf16_gemm.kernel() is not None else 0)  # the LM's two and its head
    monkeypatch.setattr(cpu_layout, "cpu_has_bfloat16_arithmetic", lambda: False)
    model = Model()
    emulated = prepare_for_cpu(model)
    assert emulated.upcast_bfloat16 == 4  # the vision layer, the LM's two and its head
    assert isinstance(model.language_model.lm_head, BFloat16ViaFloat32Linear)
