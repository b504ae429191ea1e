"""The paged attention backend against a dense reference written from the mask rule alone: causal,
causal with bidirectional spans, sliding window (alone and with spans), chunked prefill over a
cached prefix, prefills and decodes mixed in one step, grouped-query and plain multi-head; on SDPA and,
where it runs, on mmserve's CPU attention kernel (decodes and short span-free prompts in one call a step,
beside SDPA for the other prefill chunks)."""

import numpy as np
import pytest
import torch

from mmserve.inputs.items import PromptPositions
from mmserve.models.layers.attention import AttentionMetadata, ContiguousKVCache, LayerAttention
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.batch import BatchBuilder
from mmserve.runner.cpu import attention as cpu_attention
from mmserve.runner.cpu.attention_plan import CpuAttentionPlan
from mmserve.runner.kv_quant import kv_format
from mmserve.runner.kv_storage import PagedKVStorage
from mmserve.runner.state import RunnerPrompt, RunnerRequest
from mmserve.sampling_params import SamplingParams

BLOCK = 4
HEAD_DIM = 8


def reference(q, k, v, spans, window, scale):
    """Per position p: softmax over keys j with (j <= p or p, j in one span) and j > p - window."""
    length, heads, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(length, heads, HEAD_DIM, dtype=torch.float64)
    for p in range(length):
        allowed = [j for j in range(length)
                   if (j <= p or any(s <= p < e and s <= j < e for s, e in spans))
                   and (window is None or j > p - window)]
        for h in range(heads):
            keys, values = k[allowed, h // group].double(), v[allowed, h // group].double()
            weights = torch.softmax(keys @ q[p, h].double() * scale, dim=0)
            out[p, h] = weights @ values
    return out.reshape(length, -1)


def _request(rid, length, spans, blocks, num_computed=0, num_prompt_tokens=None):
    """A runner request of `length` tokens (the first `num_prompt_tokens` its prompt: all, unless given) with
    its bidirectional spans and KV blocks."""
    prompt = RunnerPrompt(PromptPositions(1), None, None, (), (), (), spans)
    return RunnerRequest(rid, list(range(length)), num_prompt_tokens or length, prompt, SamplingParams(), blocks,
                         num_computed)


# (length, spans, chunk schedule: tokens per step, 0 = not scheduled that step)
SEQUENCES = [
    (14, (), [10, 1, 1, 1, 1]),
    (20, ((2, 6), (9, 13)), [7, 9, 1, 1, 1]),
    (17, ((3, 8),), [0, 12, 1, 1, 1]),
    (9, ((0, 5),), [5, 1, 1, 1, 1]),
    (16, ((2, 5),), [7, 1, 4, 4, 0]),  # a 7-token prompt, then a decode and two chunks past it (drafts verified)
]
PROMPT_TOKENS = {4: 7}  # sequences whose prompt is shorter than their tokens


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_spans", [True, False])
@pytest.mark.parametrize("kernel", [pytest.param("decodes and short prompts", marks=pytest.mark.kernels),
                                    pytest.param("decodes only", marks=pytest.mark.kernels), "off"])
def test_paged_backend_equals_dense_reference(heads, kv_heads, window, with_spans, kernel, monkeypatch):
    cpu_kernel = kernel != "off"
    if cpu_kernel and not cpu_attention.available():
        pytest.skip("mmserve's CPU kernels do not run here")
    if not cpu_kernel:
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
    torch.manual_seed(0)
    storage = PagedKVStorage(1, 64, BLOCK, kv_heads, HEAD_DIM, kv_format("auto", torch.float32))
    # "decodes only": every prompt counts as long, so its prefill chunks go to SDPA
    backend = PagedAttentionBackend(storage, CpuAttentionPlan(enabled=True, max_prompt_tokens=0)
                                    if kernel == "decodes only" else None)
    assert backend.cpu_plan.enabled == cpu_kernel
    kernel_calls = []
    original = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a, **kw: kernel_calls.append(1) or original(*a, **kw))
    layer = LayerAttention(sliding_window=window, scale=0.3)
    free = list(np.random.default_rng(0).permutation(64))  # blocks scattered over the pool
    states, tensors, expected = [], [], []
    for i, (length, spans, _) in enumerate(SEQUENCES):
        spans = spans if with_spans else ()
        q, k, v = torch.randn(length, heads, HEAD_DIM), torch.randn(length, kv_heads, HEAD_DIM), \
            torch.randn(length, kv_heads, HEAD_DIM)
        tensors.append((q, k, v))
        expected.append(reference(q, k, v, spans, window, 0.3))
        blocks = [int(free.pop()) for _ in range(-(-length // BLOCK))]
        states.append(_request(f"s{i}", length, spans, blocks, num_prompt_tokens=PROMPT_TOKENS.get(i)))
    for step in range(len(SEQUENCES[0][2])):
        builder = BatchBuilder(BLOCK, torch.device("cpu"), backend.cpu_plan)
        rows = []
        for state, (_, _, schedule) in zip(states, SEQUENCES):
            num = schedule[step]
            start = state.num_computed_tokens
            if num == 0 or start >= len(state.token_ids):
                continue
            builder.add(state, num, [], {})
            rows.append((state, slice(start, start + num)))
        batch = builder.build()
        index = {s.request_id: i for i, s in enumerate(states)}
        q = torch.cat([tensors[index[s.request_id]][0][sl] for s, sl in rows])
        k = torch.cat([tensors[index[s.request_id]][1][sl] for s, sl in rows])
        v = torch.cat([tensors[index[s.request_id]][2][sl] for s, sl in rows])
        kernel_calls.clear()
        out = backend.forward(0, q, k, v, batch.attn, layer)
        # per request: decodes and chunks past the prompt, and the prefill chunks of short prompts without
        # spans, are the kernel's (one call for the step); the other chunks go to SDPA in the same step
        kernel_rows = [sl.stop - sl.start == 1 and sl.start > 0 or sl.start >= state.num_prompt_tokens or (
            not state.prompt.attention_spans and kernel != "decodes only") for state, sl in rows]
        tokens = batch.attn.kernel_tokens  # none at all where the plan has the kernel off
        on_kernel = cpu_kernel and any(kernel_rows)
        assert (tokens.sequences if tokens is not None else []) == (kernel_rows if on_kernel else [])
        assert (tokens is not None) == on_kernel
        assert len(kernel_calls) == (1 if cpu_kernel and any(kernel_rows) else 0)
        offset = 0
        for state, sl in rows:
            n = sl.stop - sl.start
            want = expected[index[state.request_id]][sl].float()
            torch.testing.assert_close(out[offset:offset + n], want, atol=1e-5, rtol=1e-5)
            offset += n
            state.num_computed_tokens += n
    assert batch.attn.decode_groups  # the last steps ran the decode path


def test_contiguous_cache_applies_the_same_rule():
    torch.manual_seed(1)
    length, spans = 12, ((2, 7),)
    q, k, v = torch.randn(length, 4, HEAD_DIM), torch.randn(length, 2, HEAD_DIM), torch.randn(length, 2, HEAD_DIM)
    cache = ContiguousKVCache(1, 1, length, 2, HEAD_DIM, torch.float32)
    layer = LayerAttention(sliding_window=4)
    got = [cache.forward(0, q[:9], k[:9], v[:9], AttentionMetadata([9], [0], [spans]), layer)]
    for p in range(9, length):
        got.append(cache.forward(0, q[p:p + 1], k[p:p + 1], v[p:p + 1], AttentionMetadata([1], [p]), layer))
    torch.testing.assert_close(torch.cat(got), reference(q, k, v, spans, 4, HEAD_DIM ** -0.5).float(),
                               atol=1e-5, rtol=1e-5)


def test_a_chunk_ending_inside_a_span_is_refused():
    q, k, v = torch.randn(5, 2, HEAD_DIM), torch.randn(5, 2, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    cache = ContiguousKVCache(1, 1, 16, 2, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="chunk ended inside"):
        cache.forward(0, q, k, v, AttentionMetadata([5], [0], [((3, 8),)]))


def test_chunk_starting_inside_a_span_over_shared_prefix_blocks():
    """A prefix-cache hit may end inside a span (the blocks were computed by a chunk that held the
    whole span): the rest of the span attends to the cached part of it and the cached part's keys."""
    torch.manual_seed(2)
    length, spans = 16, ((3, 10),)
    q, k, v = torch.randn(length, 4, HEAD_DIM), torch.randn(length, 2, HEAD_DIM), torch.randn(length, 2, HEAD_DIM)
    storage = PagedKVStorage(1, 16, BLOCK, 2, HEAD_DIM, kv_format("auto", torch.float32))
    backend = PagedAttentionBackend(storage, CpuAttentionPlan())  # chunks with spans: never the kernel's anyway
    first = _request("a", length, spans, [5, 2, 9, 11])
    builder = BatchBuilder(BLOCK, torch.device("cpu"), backend.cpu_plan)
    builder.add(first, length, [], {})
    backend.forward(0, q, k, v, builder.build().attn)
    # the second sequence shares blocks 5 and 2 (tokens [0, 8)) and computes [8, 16) itself
    second = _request("b", length, spans, [5, 2, 7, 3], num_computed=8)
    builder = BatchBuilder(BLOCK, torch.device("cpu"), backend.cpu_plan)
    builder.add(second, 8, [], {})
    out = backend.forward(0, q[8:], k[8:], v[8:], builder.build().attn)
    torch.testing.assert_close(out, reference(q, k, v, spans, None, HEAD_DIM ** -0.5)[8:].float(),
                               atol=1e-5, rtol=1e-5)
