"""`relayout_for_cpu`: float32 linear weights re-stored as transposed views of contiguous (in, out)
tensors (the CPU gemm's fast layout), with the same products; other dtypes and devices untouched."""

import torch
from torch import nn

from mmserve import LLM
from mmserve.runner.cpu_layout import relayout_for_cpu


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


def test_the_engine_relayouts_its_float32_language_model_only(checkpoint_dirs):
    with LLM(str(checkpoint_dirs["qwen2_vl"])) as llm:
        model = llm.engine.model
        lm = [m for m in model.language_model.modules() if isinstance(m, nn.Linear)]
        assert lm and all(m.weight.stride() == (1, m.weight.shape[0]) for m in lm)
        vision = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith("language_model")]
        assert vision and all(m.weight.is_contiguous() for m in vision)
    with LLM(str(checkpoint_dirs["qwen2_vl"]), dtype="bfloat16") as llm:
        assert all(m.weight.is_contiguous() for m in llm.engine.model.modules() if isinstance(m, nn.Linear))
