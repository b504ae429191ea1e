"""Quantized KV storage: round-trip bounds per format, attention over quantized blocks against the
dense reference, and blocks that read back exactly what was written (as prefix-cache reuse needs)."""

import pytest
import torch

from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.batch import BatchBuilder
from mmserve.runner.kv_quant import dequantize, fp8_decode_table, kv_format, quantize
from mmserve.runner.kv_storage import PagedKVStorage
from tests.unit.test_attention_backend import HEAD_DIM, reference
from tests.unit.test_attention_backend import _request as request

# attention outputs over unit-normal q/k/v differ from the full-precision reference by at most this
ATTENTION_TOLERANCE = {"int8": 0.02, "fp8_e4m3": 0.08}


def _vectors(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(500, 4, 64)
    x[:, 1] *= 30.0  # an outlier head: its own scale keeps the others precise
    x[:, 2] *= 1e-3
    x[7] = 0.0  # a zero vector
    return x


def test_int8_round_trip_is_within_half_a_step_per_token_and_head():
    fmt = kv_format("int8", torch.float32)
    x = _vectors()
    codes, scale = quantize(x, fmt)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == x.shape[:2]
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    assert (err <= scale.float()[..., None] / 2).all()  # half a step of the stored scale
    # which is max |x| / 127 (rounded up to a float16: within 2^-10 where the scale is a normal float16)
    normal = x.abs().amax(-1) / 127 >= torch.finfo(torch.float16).tiny
    assert normal[8:, [0, 1, 3]].all()  # the bound below covers the ordinary heads
    assert (err.amax(-1)[normal] <= (x.abs().amax(-1) / 254 * (1 + 2 ** -10))[normal]).all()
    assert torch.equal(dequantize(codes, scale, torch.float32)[7], torch.zeros(4, 64))


def test_fp8_round_trip_keeps_three_mantissa_bits_per_token_and_head():
    fmt = kv_format("fp8_e4m3", torch.float32)
    x = _vectors()
    codes, scale = quantize(x, fmt)
    assert codes.dtype == torch.float8_e4m3fn
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    # e4m3: relative error <= 2^-4, plus half the smallest subnormal step (2^-10 of the scale) near 0
    assert (err <= x.abs() * 2 ** -4 + scale.float()[..., None] * 2 ** -10 + 1e-7).all()
    assert torch.equal(dequantize(codes, scale, torch.float32)[7], torch.zeros(4, 64))


def test_quantized_bytes_per_token_count_codes_and_scales():
    auto32, auto16 = kv_format("auto", torch.float32), kv_format("auto", torch.bfloat16)
    int8, fp8 = kv_format("int8", torch.float32), kv_format("fp8_e4m3", torch.bfloat16)
    args = (10, 2, 64)  # layers, kv heads, head dim
    assert PagedKVStorage.bytes_per_token(*args, auto32) == 2 * 10 * 2 * 64 * 4
    assert PagedKVStorage.bytes_per_token(*args, auto16) == 2 * 10 * 2 * 64 * 2
    assert PagedKVStorage.bytes_per_token(*args, int8) == PagedKVStorage.bytes_per_token(*args, fp8) == 2 * 10 * 2 * 66
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_format("int4", torch.float32)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_attention_over_quantized_blocks_is_close_to_the_dense_reference(name):
    torch.manual_seed(1)
    length, spans = 24, ((3, 9),)
    q, k, v = torch.randn(length, 4, HEAD_DIM), torch.randn(length, 2, HEAD_DIM), torch.randn(length, 2, HEAD_DIM)
    storage = PagedKVStorage(1, 16, 4, 2, HEAD_DIM, kv_format(name, torch.float32))
    backend = PagedAttentionBackend(storage)
    state = request("s", length, spans, [3, 8, 1, 12, 6, 0])
    outputs = []
    for num in (10, 6, 1, 1, 1, 1, 1, 1, 1, 1):  # a prefill, a chunk over the quantized prefix, then decodes
        builder = BatchBuilder(4, torch.device("cpu"))
        builder.add(state, num, [], {})
        sl = slice(state.num_computed_tokens, state.num_computed_tokens + num)
        outputs.append(backend.forward(0, q[sl], k[sl], v[sl], builder.build().attn))
        state.num_computed_tokens += num
    want = reference(q, k, v, spans, None, HEAD_DIM ** -0.5).float()
    got = torch.cat(outputs)
    assert (got[:10] - want[:10]).abs().max() < 1e-5  # a fresh prefill attends over its own keys
    assert (got - want).abs().max() < ATTENTION_TOLERANCE[name]


@pytest.mark.parametrize("name", ["auto", "int8", "fp8_e4m3"])
def test_blocks_read_back_what_was_written(name):
    fmt = kv_format(name, torch.float32)
    storage = PagedKVStorage(2, 8, 4, 2, 16, fmt)
    torch.manual_seed(2)
    k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    slots = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])  # blocks 1 and 3
    storage.write(1, slots, k, v)
    blocks = torch.tensor([1, 3])
    first = storage.gather(1, blocks, torch.float32)
    storage.write(1, torch.tensor([0, 1, 2, 8, 9]), torch.randn(5, 2, 16), torch.randn(5, 2, 16))  # others
    storage.write(0, slots, torch.randn(8, 2, 16), torch.randn(8, 2, 16))  # another layer
    again = storage.gather(1, blocks, torch.float32)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    expected = k if not fmt.quantized else dequantize(*quantize(k, fmt), torch.float32)
    assert torch.equal(first[0].flatten(0, 1), expected)


def test_fp8_decode_table_equals_torchs_conversion():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).view(4, 64)
    scale = torch.full((4,), 0.5, dtype=torch.float16)
    fast = dequantize(codes, scale, torch.float32, fp8_decode_table("cpu"))
    assert torch.equal(fast.nan_to_num(), dequantize(codes, scale, torch.float32).nan_to_num())
