"""The engine's greedy output equals transformers' `generate`, run per request, whatever the
batching, chunking, preemption or prefix caching — for every family the engine serves
(docs/architecture.md, invariant 9), on every device (`devices()`: the CPU, and CUDA where one exists,
each against transformers on the same device)."""

import pytest

from mmserve import LLM
from testkit.conversations import GREEDY, parity_workload
from tests.models.helpers import devices


@pytest.fixture(params=devices())
def device(request):
    return request.param


@pytest.fixture
def expected(expected_tokens, served_family, device):
    return expected_tokens(served_family, device)



def _run(llm, family):
    outputs = llm.chat(parity_workload(family), GREEDY, use_tqdm=False)
    llm.check_integrity()
    return [o.outputs[0].token_ids for o in outputs], outputs


def test_defaults(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), device=device)
    got, outputs = _run(llm, served_family)
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.get_stats()
    assert stats["requests_finished"] == 16 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chunked_prefill_through_images(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), max_num_batched_tokens=32, device=device)
    got, _ = _run(llm, served_family)
    assert got == expected


def test_preemption(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), num_kv_blocks=24, max_num_batched_tokens=256, device=device)
    got, _ = _run(llm, served_family)
    assert llm.get_stats()["num_preemptions"] > 0
    assert got == expected


def test_prefix_caching_second_run(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), device=device)
    first, _ = _run(llm, served_family)
    before = llm.get_stats()
    second, outputs = _run(llm, served_family)
    after = llm.get_stats()
    assert first == second == expected
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert computed < 0.2 * prompt_tokens, (computed, prompt_tokens)
    assert sum(o.num_cached_tokens for o in outputs) == prompt_tokens - computed
