"""Prometheus metrics of one server, in its own `CollectorRegistry` (never the global one).

Role: per-request observations made when a request finishes (count by finish reason,
time-to-first-token, time-per-output-token, end-to-end latency) plus every number of
`Engine.get_stats()` exported at scrape time from the engine's latest snapshot: counters for the
monotonic ones, gauges for the rest, all named `mmserve_<stat>`, and `mmserve_kv_blocks_in_use`.
Behind replicas the same names carry the sums, `mmserve_replica_<stat>{replica}` each replica's, and
`mmserve_routed_total{policy, reason}` and the expected cache hits the router's. Beside them, vLLM's
`vllm:*` families (vllm_metrics.py), fed the same outputs and stats.
What it does not know: HTTP, the engine thread; it is fed outputs and a stats function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.entrypoints.openai.vllm_metrics import VllmMetrics
from mmserve.outputs import RequestOutput

PREFIX = "mmserve_"
# get_stats() keys that only ever grow; every other key is a gauge (a level or a configured size)
MONOTONIC_STATS = frozenset({
    "requests_finished", "requests_rejected", "prompt_tokens", "prompt_tokens_computed",
    "prefix_cache_hit_tokens", "prefix_cache_queries", "generation_tokens", "num_preemptions", "kv_cache_evictions",
    "encoder_items_encoded", "encoder_tokens_encoded", "encoder_cache_hits", "encoder_cache_misses",
    "encoder_cache_evictions", "encoder_worker_restarts", "encoder_items_redispatched", "replica_restarts",
    "cross_kv_builds",
})
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5)

StatsFn = Callable[[], dict[str, Any]]


class _EngineStatsCollector(Collector):
    def __init__(self, stats: StatsFn) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from _stat_families(PREFIX, {k: v for k, v in stats.items() if k not in ("replicas", "router")})
        if "kv_blocks_total" in stats and "kv_blocks_free" in stats:
            yield GaugeMetricFamily(PREFIX + "kv_blocks_in_use", "KV cache blocks held by requests or cached",
                                    value=stats["kv_blocks_total"] - stats["kv_blocks_free"])
        replicas = stats.get("replicas")
        if isinstance(replicas, list):
            yield from _replica_families(replicas)
        router = stats.get("router")
        if isinstance(router, dict):
            yield from _router_families(router)


def _stat_families(prefix: str, stats: dict[str, Any]) -> Iterator[Metric]:
    for key, value in sorted(stats.items()):
        if isinstance(value, str):  # a setting (e.g. kv_cache_dtype): an info gauge, the value as a label
            info = GaugeMetricFamily(prefix + key + "_info", f"engine setting {key}", labels=[key])
            info.add_metric([value], 1)
            yield info
        elif isinstance(value, int | float):
            if key in MONOTONIC_STATS:
                yield CounterMetricFamily(prefix + key, f"engine stat {key} (cumulative)", value=value)
            else:
                yield GaugeMetricFamily(prefix + key, f"engine stat {key}", value=value)


def _replica_families(replicas: list[dict[str, Any]]) -> Iterator[Metric]:
    """One family per numeric stat, a series per replica (its own counters restart with it)."""
    keys = sorted({k for r in replicas for k, v in r.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("replica", "pid")})
    for key in keys:
        family = GaugeMetricFamily(PREFIX + "replica_" + key, f"replica stat {key}", labels=["replica"])
        for r in replicas:
            if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool):
                family.add_metric([str(r["replica"])], r[key])
        yield family
    alive = GaugeMetricFamily(PREFIX + "replica_alive", "1 while the replica serves", labels=["replica"])
    for r in replicas:
        alive.add_metric([str(r["replica"])], 1 if r.get("alive") else 0)
    yield alive


def _router_families(router: dict[str, Any]) -> Iterator[Metric]:
    routed = CounterMetricFamily(PREFIX + "routed", "requests routed to a replica, by policy and reason",
                                 labels=["policy", "reason"])
    for row in router.get("routed", []):
        routed.add_metric([row["policy"], row["reason"]], row["requests"])
    yield routed
    yield CounterMetricFamily(PREFIX + "router_expected_encoder_cache_hits",
                              "media items the router expected its chosen replicas to hold (compare "
                              "mmserve_encoder_cache_hits)", value=router.get("expected_encoder_cache_hits", 0))
    yield CounterMetricFamily(PREFIX + "router_expected_prefix_cache_tokens",
                              "prompt tokens the router expected its chosen replicas to hold (compare "
                              "mmserve_prefix_cache_hit_tokens)", value=router.get("expected_prefix_cache_tokens", 0))


class ServerMetrics:
    """Collectors of one server. `observe` is thread-safe (called from the engine thread)."""

    def __init__(self, model_name: str = "", max_model_len: int = 2048,
                 cache_info: dict[str, str] | None = None) -> None:
        """`model_name`, `max_model_len`, `cache_info`: what vLLM's families (vllm_metrics.py) label and size
        their buckets by."""
        self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(self.registry, model_name, max_model_len, cache_info or {})
        self.requests = Counter(PREFIX + "requests", "finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "arrival to first output token", buckets=LATENCY_BUCKETS_S,
                                             registry=self.registry)
        self.time_per_output_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                               "mean time between output tokens after the first",
                                               buckets=TOKEN_BUCKETS_S, registry=self.registry)
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "arrival to finish",
                                     buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.encode_latency = Histogram(PREFIX + "encoder_worker_latency_seconds",
                                        "an item's encode on a worker, handed over to arrived", ["worker"],
                                        buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def attach_engine_stats(self, stats: StatsFn) -> None:
        self.registry.register(_EngineStatsCollector(stats))
        self.vllm.attach_engine_stats(stats)

    def observe_encoded(self, worker: int, latency_s: float) -> None:
        """Record an item an encoder worker returned."""
        self.encode_latency.labels(worker=str(worker)).observe(latency_s)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request."""
        self.vllm.observe(output)
        completion = output.outputs[0]
        self.requests.labels(finish_reason=completion.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(m.first_token_time - m.arrival_time, 0.0))
            num_tokens = len(completion.token_ids)
            if m.finish_time is not None and num_tokens > 1:
                self.time_per_output_token.observe(max(m.finish_time - m.first_token_time, 0.0) / (num_tokens - 1))
        if m.finish_time is not None:
            self.e2e_latency.observe(max(m.finish_time - m.arrival_time, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cache_info(cache: Any) -> dict[str, str]:
    """The KV cache settings (config.py's CacheConfig) as vllm:cache_config_info's labels: each field by its
    name, and vLLM's names where one means the same (cache_dtype)."""
    info = {f.name: str(getattr(cache, f.name)) for f in dataclasses.fields(cache)}
    info["cache_dtype"] = info.get("kv_cache_dtype", "auto")
    return info
