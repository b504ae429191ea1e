"""The KV budget split between the full pool and the sliding layers' window pool (engine/kv_pools.py), and
glibc's malloc tuning a CPU engine applies (runner/cpu/malloc.py)."""

import ctypes

import pytest
import torch

from mmserve.config import CacheConfig
from mmserve.engine.kv_pools import resolve_kv_pools, window_pool_cap
from mmserve.models.spec import KVLayerShape
from mmserve.runner.cpu import malloc
from mmserve.runner.kv_quant import kv_format

FMT = kv_format("auto", torch.float32)
# Gemma 4's tiny shape: a sliding layer, a full one, a sliding one, and two reading them
LAYERS = (KVLayerShape(1, 16, sliding_window=16), KVLayerShape(1, 32), KVLayerShape(1, 16, sliding_window=16),
          KVLayerShape(1, 16, 2, sliding_window=16), KVLayerShape(1, 32, 1))
FULL, SLIDING = 2 * 32 * 4, 2 * 2 * 16 * 4  # bytes a token: the full owner's, the two sliding owners'


def test_the_window_pool_gets_what_its_requests_need_and_the_full_pool_the_rest():
    cap = window_pool_cap(16, 16, max_num_seqs=4, max_tokens_per_step=256)
    assert cap == 4 * 3 + 16
    budget = 1000 * 16 * FULL + cap * 16 * SLIDING
    pools = resolve_kv_pools(CacheConfig(kv_cache_bytes=budget), LAYERS, 16, FMT, 0, 4, 256)
    assert (pools.num_blocks, pools.num_window_blocks) == (1000, cap)
    assert (pools.full_bytes_per_token, pools.window_bytes_per_token) == (FULL, SLIDING)
    # a request of 4096 tokens: its 256 full blocks and the 2 blocks its window straddles
    assert pools.request_bytes(4096) == 4096 * FULL + 2 * 16 * SLIDING


def test_a_budget_below_the_window_pools_need_gives_both_pools_one_pools_blocks():
    budget = 20 * 16 * (FULL + SLIDING)
    pools = resolve_kv_pools(CacheConfig(kv_cache_bytes=budget), LAYERS, 16, FMT, 0, 64, 2048)
    assert pools.num_blocks == pools.num_window_blocks == 20
    given = resolve_kv_pools(CacheConfig(num_kv_blocks=500), LAYERS, 16, FMT, 0, 2, 64)
    assert (given.num_blocks, given.num_window_blocks) == (500, window_pool_cap(16, 16, 2, 64))


def test_without_a_window_one_pool_holds_every_owner_layer():
    pools = resolve_kv_pools(CacheConfig(kv_cache_bytes=100 * 16 * (FULL + SLIDING)), LAYERS, None, FMT, 0, 4, 256)
    assert (pools.num_blocks, pools.window_tokens) == (100, None)
    assert pools.request_bytes(160) == 160 * (FULL + SLIDING)


def test_glibcs_malloc_is_tuned_unless_the_environment_says_no(monkeypatch):
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        pytest.skip("not glibc: nothing to tune")
    monkeypatch.setenv("MMSERVE_CPU_MALLOC_TUNING", "0")
    assert malloc.tune_malloc() is False
    monkeypatch.delenv("MMSERVE_CPU_MALLOC_TUNING")
    assert malloc.tune_malloc() is True
