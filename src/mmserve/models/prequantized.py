"""Checkpoints stored quantized: a `quantization_config` in config.json, its tensors read as stored.

Role: recognise the formats mmserve runs and turn each checkpoint tensor of a quantized linear into
the codes, scales and zero points of `quantization.QuantizedLinear` (the layout its kernels read):
never through float weights. Formats:
- `compressed-tensors` (what llm-compressor writes): `pack-quantized` int4 (symmetric or not, group
  or channel scales; `weight_packed` is eight codes per int32 along the input, code + 8 unsigned,
  which is the same bytes as two codes a byte, the even input low; with dynamic per-token int8 inputs
  it runs as w4a8), and `int-quantized` /
  `naive-quantized` int8 with channel scales, weight-only or with dynamic per-token int8 inputs (w8a8).
- `awq` (AutoAWQ's GEMM layout): `qweight` (in, out / 8) int32, eight outputs a word in the order
  0 2 4 6 1 3 5 7; `qzeros` (groups, out / 8) alike; `scales` (groups, out).
- `gptq` (AutoGPTQ / GPTQModel): `qweight` (in / 8, out) int32, eight inputs a word in order;
  `qzeros` (groups, out / 8), stored less one in the original `gptq` checkpoint format (not in
  `gptq_v2`); `scales` (groups, out); `g_idx` must be the plain group of each input (act-order
  checkpoints, whose inputs are permuted, are refused).
Anything else (another method, bit width, strategy, activation scheme) is refused at start with a
`ModelLoadError` naming it.

What it does not know: families' names (the loader maps prefixes), kernels, the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.errors import ModelLoadError
from mmserve.models.quantization import WeightFormat, pack_int4

PREQUANTIZED_METHODS = ("compressed-tensors", "awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ word nibble i holds output column AWQ_ORDER[i] of its eight
CT_INT4_FORMATS = ("pack-quantized",)
CT_INT8_FORMATS = ("int-quantized", "naive-quantized")

# a checkpoint tensor turned into ours: (name, tensor, keep its dtype: a quantization tensor)
Converted = tuple[str, torch.Tensor, bool]


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's `quantization_config` says, for the tensors of its quantized linears."""

    method: str  # one of PREQUANTIZED_METHODS
    bits: int
    group_size: int | None  # inputs per scale; None: the whole input (one scale per output channel)
    int8_activations: bool = False
    zero_point_offset: int = 0  # added to stored zero points (GPTQ's original format stores them less one)
    ct_symmetric: bool = True  # compressed-tensors int4: no zero point stored (it is 8)
    ct_format: str = ""

    def weight_format(self, in_features: int) -> WeightFormat:
        if self.bits == 8:
            return WeightFormat(8, int8_activations=self.int8_activations)
        group = self.group_size or in_features
        if in_features % group:
            raise ModelLoadError(f"{self.method}: group size {group} does not divide a layer's {in_features} inputs")
        if self.int8_activations and group % 8:
            raise ModelLoadError(f"{self.method}: int4 weights with int8 inputs need groups of a multiple of 8 "
                                 f"inputs; got {group}")
        return WeightFormat(4, group, int8_activations=self.int8_activations)

    def marks_quantized(self, hf_name: str, dtype: torch.dtype) -> str | None:
        """The linear's prefix when `hf_name` is the tensor that says the linear is stored quantized."""
        for suffix in (".qweight", ".weight_packed"):
            if hf_name.endswith(suffix):
                return hf_name[: -len(suffix)]
        if self.method == "compressed-tensors" and self.bits == 8 and hf_name.endswith(".weight") \
                and dtype == torch.int8:
            return hf_name[: -len(".weight")]
        return None

    # ---- tensors --------------------------------------------------------------------------------
    def convert(self, hf_name: str, tensor: torch.Tensor) -> Iterator[Converted]:
        """Our tensors for one checkpoint tensor (none for bookkeeping ones, the tensor itself when it
        is not a quantization tensor)."""
        prefix, _, leaf = hf_name.rpartition(".")
        if self.method == "compressed-tensors":
            yield from self._compressed_tensors(prefix, leaf, tensor)
        elif self.method == "awq":
            yield from self._awq(prefix, leaf, tensor)
        else:
            yield from self._gptq(prefix, leaf, tensor)

    def _compressed_tensors(self, prefix: str, leaf: str, tensor: torch.Tensor) -> Iterator[Converted]:
        if leaf == "weight_packed":  # (N, K / 8) int32 == (N, K / 2) bytes, codes + 8
            yield f"{prefix}.qweight", _int32_bytes(tensor), True
        elif leaf == "weight" and tensor.dtype == torch.int8:
            yield f"{prefix}.qweight", tensor, True
        elif leaf == "weight_scale":
            scales = tensor.float()
            if self.bits == 8 and scales.numel() == 1:  # one scale for the tensor: the same for each channel
                scales = scales.reshape(1, 1)
            yield f"{prefix}.scales", scales, True
            if self.bits == 4 and self.ct_symmetric:
                yield f"{prefix}.zeros", torch.full_like(scales, 8.0), True
        elif leaf == "weight_zero_point":
            if self.bits == 8:
                if torch.count_nonzero(tensor):
                    raise ModelLoadError(f"compressed-tensors: {prefix} has int8 zero points; mmserve runs "
                                         "symmetric int8 weights only")
                return
            # (ceil(N / 8), G) int32: eight outputs a word along dim 0, each zero point + 8
            codes = _unpack_int32_nibbles(tensor.t().contiguous())  # (G, 8 * words)
            yield f"{prefix}.zeros", codes.t().float(), True
        elif leaf == "weight_shape":
            return
        else:
            yield f"{prefix}.{leaf}", tensor, False

    def _awq(self, prefix: str, leaf: str, tensor: torch.Tensor) -> Iterator[Converted]:
        if leaf == "qweight":  # (K, N / 8)
            codes = _awq_columns(tensor)  # (K, N)
            yield f"{prefix}.qweight", pack_int4(codes.t()), True
        elif leaf == "qzeros":  # (G, N / 8)
            yield f"{prefix}.zeros", _awq_columns(tensor).t().float() + self.zero_point_offset, True
        elif leaf == "scales":  # (G, N)
            yield f"{prefix}.scales", tensor.float().t().contiguous(), True
        else:
            yield f"{prefix}.{leaf}", tensor, False

    def _gptq(self, prefix: str, leaf: str, tensor: torch.Tensor) -> Iterator[Converted]:
        if leaf == "qweight":  # (K / 8, N): eight inputs a word
            codes = _unpack_int32_nibbles(tensor.t().contiguous())  # (N, K)
            yield f"{prefix}.qweight", pack_int4(codes), True
        elif leaf == "qzeros":  # (G, N / 8): eight outputs a word
            zeros = _unpack_int32_nibbles(tensor).t().float() + self.zero_point_offset
            yield f"{prefix}.zeros", zeros, True
        elif leaf == "scales":
            yield f"{prefix}.scales", tensor.float().t().contiguous(), True
        elif leaf == "g_idx":
            group = self.group_size or tensor.numel()
            plain = torch.arange(tensor.numel(), dtype=torch.int64) // group
            if not torch.equal(tensor.long(), plain):
                raise ModelLoadError(f"gptq: {prefix}.g_idx permutes the inputs (desc_act / act-order); mmserve "
                                     "runs GPTQ checkpoints without act-order")
        else:
            yield f"{prefix}.{leaf}", tensor, False


def _int32_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """int32 words -> their little-endian bytes, rows kept: (R, W) -> (R, 4 W) uint8."""
    return tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], -1)


def _unpack_int32_nibbles(tensor: torch.Tensor) -> torch.Tensor:
    """(R, W) int32, value j of word w in bits 4j.. -> (R, 8 W) uint8 values in word order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((tensor.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.uint8).reshape(tensor.shape[0], -1)


def _awq_columns(tensor: torch.Tensor) -> torch.Tensor:
    """(R, N / 8) AWQ words -> (R, N) uint8 values, columns in order."""
    nibbles = _unpack_int32_nibbles(tensor).view(tensor.shape[0], -1, 8)  # [..., i] = nibble i
    inverse = [AWQ_ORDER.index(j) for j in range(8)]  # column j sits in nibble inverse[j]
    return nibbles[..., inverse].reshape(tensor.shape[0], -1)


# ---- reading the config --------------------------------------------------------------------------

def _refuse(what: str) -> ModelLoadError:
    return ModelLoadError(f"this checkpoint's quantization_config asks for {what}, which mmserve does not run; "
                          f"it runs {', '.join(PREQUANTIZED_METHODS)} checkpoints (int4 / int8, see the README's "
                          "'Quantized weights')")


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuantization:
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes = {repr({k: g.get(k) for k in ("weights", "input_activations", "format")}) for g in groups}
    if len(schemes) > 1:
        raise _refuse("compressed-tensors with several quantization schemes")
    scheme = groups[0]
    fmt = scheme.get("format") or config.get("format") or ""
    weights = scheme.get("weights") or {}
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    if kind != "int":
        raise _refuse(f"compressed-tensors {kind} weights (format {fmt!r})")
    inputs = scheme.get("input_activations")
    int8_inputs = False
    if inputs:
        if not (inputs.get("num_bits") == 8 and inputs.get("type", "int") == "int" and inputs.get("dynamic")
                and inputs.get("strategy") == "token" and inputs.get("symmetric", True)):
            raise _refuse(f"compressed-tensors input activations {inputs}")
        int8_inputs = True
    if scheme.get("output_activations"):
        raise _refuse("compressed-tensors output activations")
    if bits == 4 and fmt in CT_INT4_FORMATS and strategy in ("group", "channel"):
        group = weights.get("group_size") if strategy == "group" else None
        return CheckpointQuantization("compressed-tensors", 4, group, int8_activations=int8_inputs,
                                      ct_symmetric=bool(weights.get("symmetric", True)), ct_format=fmt)
    if bits == 8 and fmt in CT_INT8_FORMATS and strategy in ("channel", "tensor") and weights.get("symmetric", True):
        return CheckpointQuantization("compressed-tensors", 8, None, int8_activations=int8_inputs, ct_format=fmt)
    raise _refuse(f"compressed-tensors {bits}-bit weights, strategy {strategy!r}, format {fmt!r}")


def read_quantization(raw_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization (None: float weights). Raises ModelLoadError for one mmserve does
    not run. Multimodal configs may carry it under `text_config`."""
    config = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get(
        "quantization_config")
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "awq":
        bits, version = config.get("bits", config.get("w_bit")), str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not config.get("zero_point", True):
            raise _refuse(f"awq with bits={bits}, version={version!r}, zero_point={config.get('zero_point', True)}")
        group = config.get("group_size", config.get("q_group_size", 128))
        return CheckpointQuantization("awq", 4, None if group in (-1, None) else int(group))
    if method == "gptq":
        bits = config.get("bits")
        if bits != 4:
            raise _refuse(f"gptq with bits={bits}")
        checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise _refuse(f"gptq checkpoint_format {checkpoint_format!r}")
        group = config.get("group_size", 128)
        return CheckpointQuantization("gptq", 4, None if group in (-1, None) else int(group),
                                      zero_point_offset=1 if checkpoint_format == "gptq" else 0)
    raise _refuse(f"quant_method {method!r}")
