"""vLLM's `vllm:*` Prometheus families at /metrics, in process: after known requests each family is there
with vLLM's type, labels and buckets, and counts that match the requests made."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.entrypoints.openai.vllm_metrics import (
    ITL_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    build_1_2_5_buckets,
)

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:mm_cache_queries", "vllm:mm_cache_hits",
            "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info", "vllm:num_requests_waiting_by_reason")
HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
              "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:request_prefill_kv_computed_tokens",
              "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:iteration_tokens_total")


def test_unit_buckets_follow_vllms_1_2_5_rule():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000


def _scrape(client) -> dict:
    return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}


def _value(family, suffix: str = "", **labels) -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vllm_families_after_known_requests(checkpoint_dirs):
    from fastapi.testclient import TestClient

    from mmserve import LLM
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    engine = LLM(str(checkpoint_dirs["qwen2_vl"])).engine
    app = build_app(AsyncEngine(engine), ServerConfig("m", MediaRules(engine.config.media)))
    chat = {"model": "m", "max_tokens": 5, "min_tokens": 5, "messages": [{"role": "user", "content": "hello there"}]}
    generated = 0
    with TestClient(app) as client:
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            generated += client.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"]
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "one two three", "max_tokens": 3,
                                                     "min_tokens": 3, "n": 2, "temperature": 1.0}).json()
        generated += reply["usage"]["completion_tokens"]
        deadline = time.monotonic() + 60  # the engine's counters land after the step that finished the requests
        while (families := _scrape(client)) and _value(families["vllm:generation_tokens"], "_total") < generated:
            assert time.monotonic() < deadline, "the engine's counters never caught up"
            time.sleep(0.05)
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    for family in families.values():
        if family.name.startswith("vllm:"):
            assert all(s.labels["model_name"] == "m" and s.labels["engine"] == "0" for s in family.samples
                       if s.name != "vllm:cache_config_info"), family.name

    # 2 chat requests of one choice and 1 completion of n=2: 4 finished sequences, all cut by max_tokens
    assert _value(families["vllm:request_success"], "_total", finished_reason="length") == 4
    assert _value(families["vllm:request_success"], "_total", finished_reason="stop") == 0
    assert _value(families["vllm:generation_tokens"], "_total") == generated == 5 + 5 + 3 + 3
    assert _value(families["vllm:request_generation_tokens"], "_sum") == generated
    assert _value(families["vllm:request_generation_tokens"], "_count") == 4
    assert _value(families["vllm:request_params_n"], "_sum") == 1 + 1 + 2
    assert _value(families["vllm:request_params_max_tokens"], "_sum") == 5 + 5 + 3
    assert _value(families["vllm:request_max_num_generation_tokens"], "_sum") == 5 + 5 + 3
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_decode_time_seconds"):
        assert _value(families[name], "_count") == 3, name
    # one inter-token latency per step after the first: 4 + 4 for the chats, 2 for the completion's last choice
    assert _value(families["vllm:inter_token_latency_seconds"], "_count") == 4 + 4 + 2
    assert _value(families["vllm:time_per_output_token_seconds"], "_sum") == pytest.approx(
        _value(families["vllm:inter_token_latency_seconds"], "_sum"))
    itl_buckets = sorted({float(s.labels["le"]) for s in families["vllm:inter_token_latency_seconds"].samples
                          if s.name.endswith("_bucket")})
    assert itl_buckets == [*ITL_BUCKETS_S, float("inf")]
    e2e_buckets = sorted({float(s.labels["le"]) for s in families["vllm:e2e_request_latency_seconds"].samples
                          if s.name.endswith("_bucket")})
    assert e2e_buckets == [*REQUEST_LATENCY_BUCKETS_S, float("inf")]
    e2e, queue = (_value(families[n], "_sum") for n in ("vllm:e2e_request_latency_seconds",
                                                        "vllm:request_queue_time_seconds"))
    inference = _value(families["vllm:request_inference_time_seconds"], "_sum")
    assert 0 <= queue <= e2e and 0 < inference <= e2e
    assert inference == pytest.approx(_value(families["vllm:request_prefill_time_seconds"], "_sum")
                                      + _value(families["vllm:request_decode_time_seconds"], "_sum"))

    stats = engine.get_stats()
    # every step's tokens: the prompts admitted and the tokens generated, summed over the steps
    assert _value(families["vllm:iteration_tokens_total"], "_sum") == stats["prompt_tokens"] + generated
    assert _value(families["vllm:iteration_tokens_total"], "_count") >= 5 + 5 + 3
    assert _value(families["vllm:prompt_tokens"], "_total") == stats["prompt_tokens"] > 0
    assert _value(families["vllm:prefix_cache_queries"], "_total") == stats["prefix_cache_queries"] > 0
    hits = _value(families["vllm:prefix_cache_hits"], "_total")
    assert hits == stats["prefix_cache_hit_tokens"] > 0  # the second chat and the second choice
    assert _value(families["vllm:prompt_tokens_cached"], "_total") > 0
    sources = {s.labels["source"]: s.value for s in families["vllm:prompt_tokens_by_source"].samples
               if s.name.endswith("_total")}
    assert sources["local_cache_hit"] == _value(families["vllm:prompt_tokens_cached"], "_total")
    assert _value(families["vllm:num_requests_running"]) == 0 and _value(families["vllm:num_requests_waiting"]) == 0
    assert 0 <= _value(families["vllm:kv_cache_usage_perc"]) <= 1
    assert _value(families["vllm:mm_cache_queries"], "_total") == 0  # text only
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == str(engine.config.cache.block_size)
    assert info["num_gpu_blocks"] == str(stats["kv_blocks_total"]) and info["enable_prefix_caching"] == "True"


def test_waiting_requests_count_those_receiving_kv_as_deferred():
    from prometheus_client import CollectorRegistry, generate_latest

    from mmserve.entrypoints.openai.vllm_metrics import VllmMetrics

    registry = CollectorRegistry()
    metrics = VllmMetrics(registry, "m", 64, {"block_size": "16"})
    metrics.attach_engine_stats(lambda: {"requests_running": 1, "requests_waiting": 2, "requests_receiving_kv": 3,
                                         "kv_blocks_total": 10, "kv_blocks_free": 4})
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert _value(families["vllm:num_requests_waiting"]) == 5
    by_reason = families["vllm:num_requests_waiting_by_reason"]
    assert _value(by_reason, reason="capacity") == 2 and _value(by_reason, reason="deferred") == 3
    assert _value(families["vllm:kv_cache_usage_perc"]) == pytest.approx(0.6)
    assert "vllm:prefix_cache_queries" not in families  # a stat the engine does not report: no family
