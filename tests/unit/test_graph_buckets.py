"""The graph bucket planner (runner/graphs/buckets.py): keys, padding, the dummy-context rule, several
attention kinds, the largest-bucket fallback, decode batch padding. Pure Python: no torch."""

import ast
from pathlib import Path

import pytest

from mmserve.runner.graphs.buckets import (
    DecodeBucket,
    EncoderBucket,
    decode_batch_sizes,
    decode_block_widths,
    default_encoder_buckets,
    pad_decode_batch,
    parse_encoder_buckets,
    plan_decode_batch,
    plan_encoder_batch,
)

BUCKETS = (EncoderBucket(64, (2,)), EncoderBucket(64, (8,)), EncoderBucket(128, (4,)), EncoderBucket(256, (8,)))


@pytest.mark.parametrize("module", ["runner/graphs/buckets.py", "models/layers/encoder_batch.py"])
def test_planner_imports_no_torch(module):
    """The planner and the batch types it reads are pure Python."""
    path = Path(__file__).resolve().parents[2] / "src" / "mmserve" / module
    tree = ast.parse(path.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in modules if m.split(".")[0] == "torch"}


def test_smallest_bucket_and_its_padding():
    plan = plan_encoder_batch([[20, 30]], BUCKETS)
    assert plan.bucket == EncoderBucket(64, (8,))  # 2 real + 1 dummy contexts do not fit (64, (2,))
    assert plan.real_tokens == 50 and plan.pad_tokens == 14
    # the dummy takes the remainder, the unused context slots one padding token each
    assert plan.context_tokens == ((20, 30, 9, 1, 1, 1, 1, 1),)
    assert plan.num_real_contexts == (2,) and plan.dummy_context_tokens(0) == (9, 1, 1, 1, 1, 1)
    assert plan.cu_seqlens(0) == [0, 20, 50, 59, 60, 61, 62, 63, 64]
    assert sum(plan.context_tokens[0]) == plan.bucket.total_tokens


def test_one_real_context_takes_the_two_context_bucket():
    plan = plan_encoder_batch([[40]], BUCKETS)
    assert plan.bucket == EncoderBucket(64, (2,))
    assert plan.context_tokens == ((40, 24),)


def test_exactly_full_bucket_takes_the_next_one():
    """A dummy context always holds >= 1 token: real tokens filling a bucket leave it no room."""
    plan = plan_encoder_batch([[64]], BUCKETS)
    assert plan.bucket == EncoderBucket(128, (4,))
    assert plan.context_tokens == ((64, 62, 1, 1),)
    assert plan_encoder_batch([[63]], BUCKETS).bucket == EncoderBucket(64, (2,))


def test_too_few_padding_tokens_for_the_dummy_slots_takes_the_next_bucket():
    # (64, (8,)) would need 6 dummy contexts of >= 1 token from 4 padding tokens
    plan = plan_encoder_batch([[30, 30]], BUCKETS)
    assert plan.bucket == EncoderBucket(128, (4,))
    assert min(plan.context_tokens[0]) >= 1


def test_too_many_contexts_takes_a_larger_bucket():
    plan = plan_encoder_batch([[1] * 7], BUCKETS)
    assert plan.bucket == EncoderBucket(64, (8,))
    assert plan_encoder_batch([[1] * 8], BUCKETS) is None  # 8 real + 1 dummy > every bucket's contexts


def test_beyond_the_largest_bucket_falls_back_to_eager():
    # 7 dummy contexts of one token each: the most the largest bucket holds
    assert plan_encoder_batch([[249]], BUCKETS).context_tokens == ((249,) + (1,) * 7,)
    assert plan_encoder_batch([[250]], BUCKETS) is None
    assert plan_encoder_batch([[256]], BUCKETS) is None
    assert plan_encoder_batch([[100, 200]], BUCKETS) is None
    assert plan_encoder_batch([[10]], ()) is None


def test_two_attention_kinds_are_one_key():
    """Qwen2.5-VL: the same tokens split per frame (full attention) and per window; the key holds both
    counts and each kind gets its own dummies from the same padding."""
    buckets = (EncoderBucket(128, (2, 4)), EncoderBucket(128, (2, 16)), EncoderBucket(128, (8, 16)))
    full, windows = [64], [16, 16, 16, 16]
    plan = plan_encoder_batch([full, windows], buckets)
    assert plan.bucket == EncoderBucket(128, (2, 16))  # 4 real windows + 1 dummy do not fit 4
    assert plan.context_tokens[0] == (64, 64)
    assert plan.context_tokens[1] == (16, 16, 16, 16) + (64 - 11,) + (1,) * 11
    assert plan.cu_seqlens(1)[-1] == plan.cu_seqlens(0)[-1] == 128
    assert plan.num_real_contexts == (1, 4)
    # two images: a full context each
    assert plan_encoder_batch([[32, 32], [16] * 4], buckets).bucket == EncoderBucket(128, (8, 16))


def test_kinds_must_cover_the_same_tokens_and_match_the_buckets():
    with pytest.raises(ValueError, match="covers"):
        plan_encoder_batch([[64], [16, 16]], (EncoderBucket(128, (2, 4)),))
    with pytest.raises(ValueError, match="attention kinds"):
        plan_encoder_batch([[64]], (EncoderBucket(128, (2, 4)),))
    with pytest.raises(ValueError, match="empty context"):
        plan_encoder_batch([[64, 0]], BUCKETS)


@pytest.mark.parametrize("bad", [(0, (2,)), (64, (1,)), (4, (8,)), (64, ())])
def test_bucket_validation(bad):
    with pytest.raises(ValueError):
        EncoderBucket(*bad)


def test_default_buckets_cover_the_budgets():
    buckets = default_encoder_buckets(max_tokens_per_step=4096, max_items_per_step=16, num_kinds=1,
                                      token_multiple=4)
    assert all(b.total_tokens % 4 == 0 for b in buckets)
    levels = sorted({b.total_tokens for b in buckets})
    assert levels == [256, 512, 1024, 2048, 4096, 4100]  # doubling, then the full step + a dummy's room
    assert {b.num_contexts for b in buckets if b.total_tokens == 4100} == {(2,), (8,), (17,)}
    # the largest legal step (the tokens budget, the items budget) has a bucket
    assert plan_encoder_batch([[256] * 16], buckets).bucket == EncoderBucket(4100, (17,))
    assert plan_encoder_batch([[4096]], buckets).bucket == EncoderBucket(4100, (2,))
    assert plan_encoder_batch([[100]], buckets).bucket == EncoderBucket(256, (2,))


def test_default_buckets_for_two_kinds():
    buckets = default_encoder_buckets(1024, 4, num_kinds=2, token_multiple=4)
    assert {b.num_contexts[1] for b in buckets if b.total_tokens == 1028} == {16, 64, 257}
    # every window a single merge block: still fits the largest level
    assert plan_encoder_batch([[1024], [4] * 256], buckets).bucket == EncoderBucket(1028, (2, 257))


def test_small_budget_gives_one_level():
    assert {b.total_tokens for b in default_encoder_buckets(100, 2, 1, token_multiple=4)} == {104}


def test_parse_engine_arg():
    assert parse_encoder_buckets([(128, 4), (64, 2)], num_kinds=2) == (EncoderBucket(64, (2, 2)),
                                                                        EncoderBucket(128, (4, 4)))
    assert parse_encoder_buckets([(128, 4, 16)], num_kinds=2) == (EncoderBucket(128, (4, 16)),)
    with pytest.raises(ValueError, match="expected"):
        parse_encoder_buckets([(128, 4, 16, 2)], num_kinds=2)


def test_decode_batch_sizes_and_padding():
    sizes = decode_batch_sizes(64)
    assert sizes == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert decode_batch_sizes(1) == (1,) and decode_batch_sizes(6) == (1, 2, 4, 6)
    assert [pad_decode_batch(n, sizes) for n in (1, 3, 5, 8, 9, 33, 64)] == [1, 4, 8, 8, 16, 48, 64]
    assert pad_decode_batch(65, sizes) is None
    with pytest.raises(ValueError):
        pad_decode_batch(0, sizes)


def test_decode_block_widths_and_plan():
    assert decode_block_widths(40) == (4, 8, 16, 32, 40)
    assert decode_block_widths(3) == (3,)
    buckets = [DecodeBucket(b, w) for b in (1, 4, 8) for w in decode_block_widths(40)]
    assert plan_decode_batch([3], buckets) == DecodeBucket(1, 4)
    assert plan_decode_batch([3, 9, 1], buckets) == DecodeBucket(4, 16)
    assert plan_decode_batch([40] * 8, buckets) == DecodeBucket(8, 40)
    assert plan_decode_batch([41], buckets) is None  # longer than any captured width
    assert plan_decode_batch([1] * 9, buckets) is None  # more decodes than the largest batch
