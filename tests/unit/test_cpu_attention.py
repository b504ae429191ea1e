"""mmserve's float32 CPU attention over the paged cache (`runner/cpu/attention.py`, `kernels/paged_attention.cpp`):
a float64 reference from the mask rule for every head size and group the kernel handles (windows,
a query at position 0, keys ending inside a block), each sequence's result independent of the batch,
the same numbers compiled as eager, the paged backend's decode path on the kernel against its SDPA
path, and the cases it leaves to SDPA."""

import pytest
import torch

from mmserve.models.layers.attention import LayerAttention
from mmserve.runner.attention import DecodeGroup, PagedAttentionBackend
from mmserve.runner.cpu import attention as cpu_attention
from mmserve.runner.kv_quant import kv_format
from mmserve.runner.kv_storage import PagedKVStorage

# builds the kernels (at setup, not at collection: the condition is a string): not in the fast tier
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif("not cpu_attention.available()",
                                 reason="mmserve's CPU kernels do not run here (no AVX2 or no C++ compiler)")]

BLOCK_SIZE = 16
NUM_BLOCKS = 40


def _case(n, heads, kv_heads, head_dim, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    value = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:n * width].view(n, width)
    positions = torch.randint(0, width * BLOCK_SIZE, (n,), generator=gen)
    positions[0] = 0  # a query that sees only its own key
    q = torch.randn(n, heads, head_dim, generator=gen)
    return q, key, value, table, positions


def _reference(q, key, value, table, positions, scale, window):
    n, heads, head_dim = q.shape
    group = heads // key.shape[2]
    out = torch.empty(n, heads, head_dim, dtype=torch.float64)
    for i in range(n):
        keys = key[table[i]].flatten(0, 1).double()
        values = value[table[i]].flatten(0, 1).double()
        pos = int(positions[i])
        visible = [j for j in range(pos + 1) if window is None or j > pos - window]
        for h in range(heads):
            weights = torch.softmax(keys[visible, h // group] @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ values[visible, h // group]
    return out.reshape(n, -1)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(10, 2, 64), (4, 4, 8), (7, 1, 16), (6, 2, 128), (3, 3, 72),
                                                    (16, 2, 72), (8, 2, 40)])  # groups of 8 and 4, a last chunk
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_matches_the_mask_rule(heads, kv_heads, head_dim, window):
    q, key, value, table, positions = _case(5, heads, kv_heads, head_dim, width=6)
    scale = head_dim ** -0.5
    got = cpu_attention.paged_attention(q, key, value, table, positions, scale, window)
    assert got.shape == (5, heads * head_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, key, value, table, positions, scale, window),
                               rtol=1e-5, atol=1e-5)


def test_a_sequence_result_does_not_depend_on_its_batch():
    q, key, value, table, positions = _case(8, 10, 2, 64, width=5)
    batched = cpu_attention.paged_attention(q, key, value, table, positions, 0.125, None)
    for i in range(8):
        alone = cpu_attention.paged_attention(q[i:i + 1], key, value, table[i:i + 1], positions[i:i + 1],
                                                     0.125, None)
        assert torch.equal(alone[0], batched[i])


def test_compiled_equals_eager():
    q, key, value, table, positions = _case(4, 4, 2, 32, width=3)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, t, p: cpu_attention.paged_attention(q * 2, key, value, t, p, 0.2, None) + 1,
        fullgraph=True, dynamic=True)
    for n in (2, 4):
        eager = cpu_attention.paged_attention(q[:n] * 2, key, value, table[:n], positions[:n], 0.2, None) + 1
        assert torch.equal(compiled(q[:n], table[:n], positions[:n]), eager)


def _backend_decode(storage, q, table, positions, layer):
    num = q.shape[0]
    width = table.shape[1]
    group = DecodeGroup(table, torch.arange(width * storage.block_size)[None, :], positions[:, None],
                        torch.arange(num))
    return PagedAttentionBackend(storage)._decode(0, q, group, layer)


@pytest.mark.parametrize("window", [None, 9])
def test_the_backend_decodes_on_the_kernel_like_on_sdpa(window, monkeypatch):
    storage = PagedKVStorage(1, NUM_BLOCKS, BLOCK_SIZE, 2, 64, kv_format("auto", torch.float32))
    q, key, value, table, positions = _case(6, 10, 2, 64, width=4, seed=3)
    storage.key[0].copy_(key)
    storage.value[0].copy_(value)
    layer = LayerAttention(sliding_window=window, scale=0.1)
    assert PagedAttentionBackend(storage).cpu_plan.enabled
    calls = []
    original = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a: calls.append(1) or original(*a))
    on_kernel = _backend_decode(storage, q, table, positions, layer)
    assert calls  # the kernel ran
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    on_sdpa = _backend_decode(storage, q, table, positions, layer)
    assert len(calls) == 1
    torch.testing.assert_close(on_kernel, on_sdpa, rtol=1e-5, atol=1e-5)


def test_what_the_kernel_leaves_to_sdpa():
    key = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 64)
    assert cpu_attention.supports(torch.zeros(3, 4, 64), key)
    assert not cpu_attention.supports(torch.zeros(3, 4, 64, dtype=torch.bfloat16), key.bfloat16())
    assert not cpu_attention.supports(torch.zeros(3, 4, 60), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 60))
    assert not cpu_attention.supports(torch.zeros(3, 4, 64), key.transpose(0, 1))
    quantized = PagedKVStorage(1, NUM_BLOCKS, BLOCK_SIZE, 2, 64, kv_format("int8", torch.float32))
    assert not PagedAttentionBackend(quantized).cpu_plan.enabled
    half = PagedKVStorage(1, NUM_BLOCKS, BLOCK_SIZE, 2, 64, kv_format("auto", torch.bfloat16))
    assert not PagedAttentionBackend(half).cpu_plan.enabled
    q, key, value, table, positions = _case(2, 4, 2, 16, width=2)
    with pytest.raises(ValueError, match="int64"):
        cpu_attention.paged_attention(q, key, value, table.int(), positions, 0.25, None)
    with pytest.raises(ValueError, match="multiple of"):
        cpu_attention.paged_attention(q[..., :12], key[..., :12], value[..., :12], table, positions, 0.25, None)
    with pytest.raises(ValueError, match="caches of one shape"):
        cpu_attention.paged_attention(q, key, value[:, :8], table, positions, 0.25, None)


def test_queries_share_their_sequence_table_row():
    """A prefill chunk's tokens: several queries on one table row, each at its own position."""
    q, key, value, table, _ = _case(3, 4, 2, 16, width=4)
    rows = torch.tensor([0, 0, 0, 2, 2, 1])
    positions = torch.tensor([4, 5, 6, 30, 31, 17])
    queries = torch.randn(6, 4, 16)
    got = cpu_attention.paged_attention(queries, key, value, table, positions, 0.25, None, rows=rows)
    expanded = cpu_attention.paged_attention(queries, key, value, table[rows], positions, 0.25, None)
    assert torch.equal(got, expanded)
    torch.testing.assert_close(got.double(), _reference(queries, key, value, table[rows], positions, 0.25, None),
                               rtol=1e-5, atol=1e-5)
