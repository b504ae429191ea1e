"""KV cache formats: what a stored key/value element is, and how a token's vector is quantized.

Role: `KVFormat` names a storage format (`auto`: the model dtype; `int8`; `fp8_e4m3`) and its
sizes; `quantize` turns (tokens, kv_heads, head_dim) vectors into codes plus one scale per token
per kv head (symmetric: scale = max |x| / the format's largest code), `dequantize` undoes it.
Scales are stored as float16: two bytes beside a head's codes, precise to 2^-11, far finer than
an int8 step. The scale is rounded up to a float16 (so no element's code overflows) and
quantization divides by that stored scale, so what is stored decodes exactly as it was meant.

What it does not know: blocks, slots, attention, requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.config import KV_CACHE_DTYPES

SCALE_DTYPE = torch.float16
# the smallest scale kept, float16's smallest subnormal (a zero vector would otherwise divide by zero)
MIN_SCALE = 2.0 ** -24


@dataclass(frozen=True)
class KVFormat:
    name: str  # one of KV_CACHE_DTYPES, "auto" resolved to the model dtype's name
    element_dtype: torch.dtype  # what a stored K/V element is
    max_code: float | None  # the largest code magnitude; None: stored as is, no scale

    @property
    def quantized(self) -> bool:
        return self.max_code is not None

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes one token's K (or V) of one kv head takes, its scale included."""
        element = torch.empty((), dtype=self.element_dtype).element_size()
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if self.quantized else 0
        return head_dim * element + scale


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    if kv_cache_dtype == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype, None)
    if kv_cache_dtype == "int8":
        return KVFormat("int8", torch.int8, 127.0)
    if kv_cache_dtype == "fp8_e4m3":
        return KVFormat("fp8_e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max))
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x (tokens, kv_heads, head_dim) -> codes of the same shape in fmt.element_dtype, scales
    (tokens, kv_heads) in SCALE_DTYPE."""
    x = x.float()
    exact = (x.abs().amax(dim=-1) / fmt.max_code).clamp(min=MIN_SCALE)
    scale = exact.to(SCALE_DTYPE)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scaled = x / scale.float()[..., None]
    if fmt.element_dtype == torch.int8:
        codes = scaled.round().clamp(-fmt.max_code, fmt.max_code).to(torch.int8)
    else:
        codes = scaled.clamp(-fmt.max_code, fmt.max_code).to(fmt.element_dtype)
    return codes, scale


def fp8_decode_table(device: torch.device | str) -> torch.Tensor:
    """(256,) float32: the value of every float8_e4m3fn bit pattern. Reading codes through it is several
    times faster on the CPU than torch's float8 -> float32 conversion."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               table: torch.Tensor | None = None) -> torch.Tensor:
    """codes (..., head_dim), scale (...) -> values in `dtype`; `table`: fp8_decode_table for fp8 codes."""
    if table is not None and codes.dtype == torch.float8_e4m3fn:
        values = table.index_select(0, codes.view(torch.uint8).flatten().int()).view(codes.shape)
    else:
        values = codes.float()
    return (values * scale.float()[..., None]).to(dtype)
