"""Checkpoints stored quantized (`models/prequantized.py`): compressed-tensors checkpoints written by the
compressed-tensors package itself load with the weights its own decompressor gives; AWQ and GPTQ
checkpoints written per their documented packings load with exactly the codes, scales and zero points
written, and serve the same tokens as each other (same codes, same kernel); a method, bit width or
layout mmserve does not run is refused at start naming it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve import LLM
from mmserve.errors import ModelLoadError
from mmserve.models.loader import load_model
from mmserve.models.prequantized import AWQ_ORDER
from mmserve.models.quantization import QuantizedLinear, WeightFormat, pack_int4, quantize_int4
from testkit.conversations import GREEDY, parity_workload
from testkit.tiny_checkpoints import build_checkpoint

GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("float"), "qwen2_vl", seed=1)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _linear_names(tensors: dict) -> list[str]:
    """The language model's projections, by their checkpoint prefix."""
    return sorted(n[: -len(".weight")] for n in tensors
                  if n.endswith(".weight") and n.startswith("model.layers.") and n.split(".")[-2] in PROJECTIONS)


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        file.unlink()
    index = dst / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _nibbles_to_int32(values: torch.Tensor) -> torch.Tensor:
    """(R, W, 8) values 0..15 -> (R, W) int32, value j in bits 4j.."""
    words = torch.zeros(values.shape[:2], dtype=torch.int64)
    for j in range(8):
        words |= values[..., j].long() << (4 * j)
    return words.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else words.to(torch.int32)


def _int4_codes(tensors: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per projection: (codes (N, K) 0..15, scales (N, G) rounded to float16 as stored, zeros (N, G))."""
    out = {}
    for name in _linear_names(tensors):
        packed, scales, zeros = quantize_int4(tensors[name + ".weight"], GROUP)
        codes = torch.stack((packed & 0x0F, packed >> 4), -1).reshape(packed.shape[0], -1)
        out[name] = codes, scales.half().float(), zeros
    return out


def _awq(tensors: dict, codes: dict) -> dict:
    out = {k: v for k, v in tensors.items() if k[: -len(".weight")] not in codes}
    for name, (c, scales, zeros) in codes.items():
        k, n = c.shape[1], c.shape[0]
        order = list(AWQ_ORDER)
        out[name + ".qweight"] = _nibbles_to_int32(c.t().reshape(k, n // 8, 8)[..., order])
        out[name + ".qzeros"] = _nibbles_to_int32(zeros.t().to(torch.uint8).reshape(-1, n // 8, 8)[..., order])
        out[name + ".scales"] = scales.t().half()
    return out


def _gptq(tensors: dict, codes: dict) -> dict:
    out = {k: v for k, v in tensors.items() if k[: -len(".weight")] not in codes}
    for name, (c, scales, zeros) in codes.items():
        n, k = c.shape
        out[name + ".qweight"] = _nibbles_to_int32(c.t().reshape(k // 8, 8, n).transpose(1, 2))
        stored = (zeros - 1).clamp(min=0).to(torch.uint8)  # the original format stores zero points less one
        out[name + ".qzeros"] = _nibbles_to_int32(stored.t().reshape(-1, n // 8, 8))
        out[name + ".scales"] = scales.t().half()
        out[name + ".g_idx"] = (torch.arange(k) // GROUP).to(torch.int32)
    return out


def _loaded_linears(model) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def _stacked(codes: dict, layer: int, parts: tuple[str, ...], block: str) -> tuple[torch.Tensor, ...]:
    names = [f"model.layers.{layer}.{block}.{p}" for p in parts]
    return tuple(torch.cat([codes[n][i] for n in names]) for i in range(3))


@pytest.fixture(scope="module")
def awq_gptq_dirs(float_dir, tmp_path_factory):
    tensors = _weights(float_dir)
    codes = _int4_codes(tensors)
    for name in codes:  # GPTQ stores zero points less one in 4 bits: keep them >= 1 to hold both
        c, s, z = codes[name]
        codes[name] = c, s, z.clamp(min=1)
    awq = _write(float_dir, tmp_path_factory.mktemp("q") / "awq", _awq(tensors, codes),
                 {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": ["visual"]})
    gptq = _write(float_dir, tmp_path_factory.mktemp("q") / "gptq", _gptq(tensors, codes),
                  {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                   "checkpoint_format": "gptq"})
    return awq, gptq, codes


@pytest.mark.parametrize("which", [0, 1], ids=["awq", "gptq"])
def test_awq_and_gptq_load_the_codes_as_written(awq_gptq_dirs, which):
    model_dir, codes = awq_gptq_dirs[which], awq_gptq_dirs[2]
    model = load_model(model_dir)
    layers = _loaded_linears(model)
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down in each of the two layers; the head stays float
    for layer in range(2):
        for ours, parts, block in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn"),
                                   ("self_attn.o_proj", ("o_proj",), "self_attn"),
                                   ("mlp.gate_up_proj", ("gate_proj", "up_proj"), "mlp"),
                                   ("mlp.down_proj", ("down_proj",), "mlp")):
            got = layers[f"language_model.layers.{layer}.{ours}"]
            c, s, z = _stacked(codes, layer, parts, block)
            assert got.fmt == WeightFormat(4, GROUP)
            assert torch.equal(got.qweight, pack_int4(c)) and torch.equal(got.scales, s) and torch.equal(got.zeros, z)


def test_awq_and_gptq_of_the_same_codes_serve_the_same_tokens(awq_gptq_dirs):
    chats = parity_workload("qwen2_vl")[:6]
    answers = []
    for model_dir in awq_gptq_dirs[:2]:
        llm = LLM(str(model_dir))
        answers.append([o.outputs[0].token_ids for o in llm.chat(chats, GREEDY, use_tqdm=False)])
        stats = llm.get_stats()
        assert stats["quantization"] in ("awq", "gptq")
        llm.check_integrity()
    assert answers[0] == answers[1]


def _compressed_tensors_checkpoint(float_dir: Path, dst: Path, bits: int, symmetric: bool,
                                   int8_inputs: bool = False) -> tuple[Path, dict]:
    """A checkpoint compressed by the compressed-tensors package, and its own decompressed weights."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    if bits == 4:
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
        compressor, fmt = PackedQuantizationCompressor, "pack-quantized"
    else:
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        compressor, fmt = IntQuantizationCompressor, "int-quantized"
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True) \
        if int8_inputs else None
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    tensors = _weights(float_dir)
    out, expected = {}, {}
    names = set(_linear_names(tensors))
    for key, value in tensors.items():
        prefix = key[: -len(".weight")]
        if prefix not in names:
            out[key] = value
            continue
        w = value.float()
        view = w.reshape(w.shape[0], -1, GROUP) if bits == 4 else w.reshape(w.shape[0], 1, -1)
        scale, zero_point = calculate_qparams(view.amin(-1), view.amax(-1), weights)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
        compressed = compressor.compress(state, scheme)
        expected[prefix] = compressor.decompress(dict(compressed), scheme)["weight"].float()
        out.update({f"{prefix}.{k}": v for k, v in compressed.items()})
    config = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head", "re:visual.*"],
              "config_groups": {"group_0": scheme.model_dump()}}
    return _write(float_dir, dst, out, json.loads(json.dumps(config, default=str))), expected


@pytest.mark.parametrize("bits,symmetric,int8_inputs", [(4, True, False), (4, False, False), (8, True, False),
                                                        (8, True, True), (4, False, True)],
                         ids=["int4-sym", "int4-asym", "int8", "w8a8", "w4a8"])
def test_compressed_tensors_loads_the_weights_its_package_decompresses(float_dir, tmp_path, bits, symmetric,
                                                                      int8_inputs):
    model_dir, expected = _compressed_tensors_checkpoint(float_dir, tmp_path / "ct", bits, symmetric, int8_inputs)
    model = load_model(model_dir)
    layers = _loaded_linears(model)
    assert len(layers) == 8 and all(m.fmt.int8_activations == int8_inputs for m in layers.values())
    for layer in range(2):
        qkv = layers[f"language_model.layers.{layer}.self_attn.qkv_proj"].dequantized_weight()
        want = torch.cat([expected[f"model.layers.{layer}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
        torch.testing.assert_close(qkv, want, rtol=1e-6, atol=1e-6)
        down = layers[f"language_model.layers.{layer}.mlp.down_proj"].dequantized_weight()
        torch.testing.assert_close(down, expected[f"model.layers.{layer}.mlp.down_proj"], rtol=1e-6, atol=1e-6)
    llm = LLM(str(model_dir))
    outputs = llm.chat(parity_workload("qwen2_vl")[:4], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    assert llm.get_stats()["quantization"] == "compressed-tensors"
    llm.check_integrity()


def _refused(float_dir: Path, dst: Path, config: dict, match: str, **kwargs) -> None:
    model_dir = _write(float_dir, dst, _weights(float_dir), config)
    with pytest.raises(ModelLoadError, match=match):
        load_model(model_dir, **kwargs)


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                 "strategy": "channel"}}}}, "float weights"),
])
def test_an_unsupported_checkpoint_quantization_is_refused_naming_it(float_dir, tmp_path, config, match):
    _refused(float_dir, tmp_path / "bad", config, match)


def test_a_prequantized_checkpoint_is_not_quantized_again(awq_gptq_dirs):
    with pytest.raises(ModelLoadError, match=r"stored quantized \(awq\).*'int8'"):
        load_model(awq_gptq_dirs[0], quantization="int8")


def test_act_order_gptq_is_refused(float_dir, tmp_path):
    tensors = _weights(float_dir)
    codes = _int4_codes(tensors)
    written = _gptq(tensors, codes)
    name = next(k for k in written if k.endswith(".g_idx"))
    written[name] = written[name].flip(0).contiguous()
    model_dir = _write(float_dir, tmp_path / "act", written,
                       {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True})
    with pytest.raises(ModelLoadError, match="act-order"):
        load_model(model_dir)
