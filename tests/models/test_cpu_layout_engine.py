"""What an engine does with the CPU's weight layouts (`runner/cpu/layout.py`; the layouts themselves:
tests/unit/test_cpu_layout.py): a float32 engine's language model packed for the panel kernel (else oneDNN,
else re-laid out) with its vision tower left alone, and a bfloat16 engine on the path its CPU needs."""

from torch import nn

from mmserve import LLM, SamplingParams
from mmserve.runner.cpu import bf16_gemm
from mmserve.runner.cpu import gemm as cpu_gemm
from mmserve.runner.cpu import layout as cpu_layout
from mmserve.runner.cpu.layout import BFloat16ViaFloat32Linear, PackedLinear


def _packed_type() -> type:
    return cpu_gemm.PanelLinear if cpu_gemm.available() else PackedLinear


def test_the_engine_packs_its_float32_language_model_and_leaves_the_vision_tower(checkpoint_dirs):
    with LLM(str(checkpoint_dirs["qwen2_vl"])) as llm:
        model = llm.engine.model
        packed = [m for m in model.language_model.modules() if isinstance(m, _packed_type())]
        assert not [m for m in model.language_model.modules() if isinstance(m, nn.Linear)]
        assert isinstance(model.language_model.lm_head, _packed_type())  # the untied head too
        assert len(packed) == llm.engine.cpu_preparation.packed > 0
        vision = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith("language_model")]
        assert vision and all(m.weight.is_contiguous() for m in vision)  # long products: MKL's own layout
    with LLM(str(checkpoint_dirs["qwen2_vl"]), dtype="bfloat16") as llm:
        assert all(m.weight.is_contiguous() for m in llm.engine.model.modules() if isinstance(m, nn.Linear))
        assert llm.engine.cpu_preparation.packed == 0


def test_without_onednn_the_engine_relayouts_instead(checkpoint_dirs, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: None)  # as on a machine where mmserve's kernel does not run
    monkeypatch.setattr(cpu_layout, "onednn_linear_available", lambda: False)
    with LLM(str(checkpoint_dirs["qwen2_vl"])) as llm:
        lm = [m for m in llm.engine.model.language_model.modules() if isinstance(m, nn.Linear)]
        assert lm and all(m.weight.stride() == (1, m.weight.shape[0]) for m in lm)
        assert llm.engine.cpu_preparation.packed == 0 and llm.engine.cpu_preparation.relaid_out == len(lm)


def test_a_bfloat16_engine_takes_the_path_its_cpu_needs(checkpoint_dirs):
    expect_upcast = not cpu_layout.cpu_has_bfloat16_arithmetic()
    with LLM(str(checkpoint_dirs["qwen2_vl"]), dtype="bfloat16") as llm:
        linears = [m for m in llm.engine.model.modules() if isinstance(m, nn.Linear)]
        assert linears and all(isinstance(m, BFloat16ViaFloat32Linear) == expect_upcast for m in linears)
        assert llm.engine.cpu_preparation.upcast_bfloat16 == (len(linears) if expect_upcast else 0)
        assert llm.engine.cpu_preparation.packed == 0
        amx = [m for m in llm.engine.model.language_model.modules() if isinstance(m, bf16_gemm.BFloat16PanelLinear)]
        assert len(amx) == llm.engine.cpu_preparation.packed_bfloat16  # the LM's linears where the AMX kernel runs
        assert (len(amx) > 0) == (bf16_gemm.kernel() is not None)
        (out,) = llm.generate(["Count to three:"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        llm.check_integrity()
