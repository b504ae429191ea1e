"""vLLM's `vllm:*` Prometheus families beside ours, so a vLLM Grafana dashboard or autoscaler reads mmserve.

Role: the families of vLLM v1's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) that have a meaning
here, with vLLM's names, types, buckets and documentation, and its `model_name` and `engine` labels
(`engine` is "0": this server's one engine, or the sum over its replicas). Built from what the engine
already reports: per-request families from each finished `RequestOutput` and its `RequestMetrics`
(arrival, first scheduling, first and last token, inter-token latencies, max_tokens), the scheduler's and
caches' families from `Engine.get_stats()` at scrape time, tokens per step from the counters each step
moved. Intervals as vLLM v1 counts them (stats.py): queue = first scheduled - arrival, prefill = first
token - first scheduled, decode = last token - first token, inference = last token - first scheduled;
one inter-token latency per step that gave tokens.
What it does not know: HTTP, the engine thread, how the stats are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.outputs import RequestOutput

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason, each shown from the start
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

StatsFn = Callable[[], dict[str, Any]]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _Families:
    """The per-request families, registered in the server's registry."""

    def __init__(self, registry: CollectorRegistry, label_values: tuple[str, str], max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*label_values)

        tokens = build_1_2_5_buckets(max_model_len)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*label_values, reason) for reason in FINISH_REASONS}
        self.success_family = success
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                             "Histogram of new KV tokens computed during prefill (excluding cached "
                                             "tokens).", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS_S)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."
                              "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS_S)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS_S)
        latency = REQUEST_LATENCY_BUCKETS_S
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             latency)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", latency)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", latency)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", latency)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", latency)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKEN_BUCKETS)
        prompt_sources = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                 [*LABELS, "source"], registry=registry)
        self.computed_tokens = prompt_sources.labels(*label_values, "local_compute")
        self.cache_hit_tokens = prompt_sources.labels(*label_values, "local_cache_hit")
        self.cached_tokens = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                                     LABELS, registry=registry).labels(*label_values)


def _stat_families(stats: dict[str, Any], label_values: tuple[str, str],
                   cache_info: dict[str, str]) -> Iterator[Metric]:
    """The families read from the engine's counters as of now (absent keys: the family is left out)."""
    def family(kind: type, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        if value is not None:
            metric = kind(name, doc, labels=LABELS)
            metric.add_metric(list(label_values), value)
            yield metric

    hits, misses = stats.get("encoder_cache_hits"), stats.get("encoder_cache_misses")
    total, free = stats.get("kv_blocks_total"), stats.get("kv_blocks_free")
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield from family(gauge, "vllm:num_requests_running", "Number of requests in model execution batches.",
                      stats.get("requests_running"))
    waiting, receiving = stats.get("requests_waiting"), stats.get("requests_receiving_kv", 0)
    # vLLM counts a request waiting for its KV from another instance as waiting, for a "deferred" reason
    yield from family(gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                      None if waiting is None else waiting + receiving)
    if waiting is not None:
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. "
                                      "Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = "
                                      "deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
                                      "Sum of all reasons equals vllm:num_requests_waiting.",
                                      labels=[*LABELS, "reason"])
        by_reason.add_metric([*label_values, "capacity"], waiting)
        by_reason.add_metric([*label_values, "deferred"], receiving)
        yield by_reason
    yield from family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                      None if not total or free is None else 1.0 - free / total)
    yield from family(counter, "vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.get("prefix_cache_queries"))
    yield from family(counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.get("prefix_cache_hit_tokens"))
    yield from family(counter, "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried "
                      "items.", None if hits is None or misses is None else hits + misses)
    yield from family(counter, "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.",
                      hits)
    yield from family(counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.get("num_preemptions"))
    yield from family(counter, "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.get("prompt_tokens"))
    yield from family(counter, "vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.get("generation_tokens"))
    info = {**cache_info, "num_gpu_blocks": str(total), "engine": label_values[1]}
    config = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                               labels=list(info))
    config.add_metric(list(info.values()), 1)
    yield config


SPEC_PREFIX = "spec_decode_num_accepted_tokens_per_pos_"


def _spec_families(stats: dict[str, Any], label_values: tuple[str, str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, with speculation on (the engine's spec_decode_* counters)."""
    for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                     ("num_draft_tokens", "Number of draft tokens."),
                     ("num_accepted_tokens", "Number of accepted tokens.")):
        if f"spec_decode_{key}" in stats:
            metric = CounterMetricFamily(f"vllm:spec_decode_{key}", doc, labels=LABELS)
            metric.add_metric(list(label_values), stats[f"spec_decode_{key}"])
            yield metric
    per_position = sorted((int(k[len(SPEC_PREFIX):]), v) for k, v in stats.items() if k.startswith(SPEC_PREFIX))
    if per_position:
        metric = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft's position.", labels=[*LABELS, "position"])
        for position, value in per_position:
            metric.add_metric([*label_values, str(position)], value)
        yield metric


class _EngineStats(Collector):
    def __init__(self, stats: StatsFn, label_values: tuple[str, str], cache_info: dict[str, str]) -> None:
        self._stats, self._label_values, self._cache_info = stats, label_values, cache_info

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from _stat_families(stats, self._label_values, self._cache_info)
        yield from _spec_families(stats, self._label_values)


class VllmMetrics:
    """vLLM's families of one server, in its registry. `observe` is thread-safe (the engine thread calls it)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 cache_info: dict[str, str]) -> None:
        """`cache_info`: the KV cache settings, as the labels of vllm:cache_config_info (vLLM's CacheConfig names
        where one means the same: block_size, cache_dtype, enable_prefix_caching)."""
        self._registry, self._cache_info = registry, cache_info
        self._label_values = (model_name, "0")
        self._families = _Families(registry, self._label_values, max_model_len)

    def attach_engine_stats(self, stats: StatsFn) -> None:
        self._registry.register(_EngineStats(stats, self._label_values, self._cache_info))

    def observe_step(self, num_tokens: int) -> None:
        """An engine step: the prompt tokens it admitted plus the tokens it generated (one engine; a replica's
        steps stay in its process)."""
        self._families.iteration_tokens.observe(num_tokens)

    def observe(self, output: RequestOutput) -> None:
        """A finished request: each choice counts as a finished sequence (vLLM's children of an n > 1 request);
        the intervals and parameters once per request."""
        f = self._families
        for completion in output.outputs:
            reason = completion.finish_reason or "abort"
            (f.success.get(reason) or f.success_family.labels(*self._label_values, reason)).inc()
            f.generation_tokens.observe(len(completion.token_ids))
            f.prompt_tokens.observe(len(output.prompt_token_ids))
        f.params_n.observe(len(output.outputs))
        f.max_generation_tokens.observe(max((len(c.token_ids) for c in output.outputs), default=0))
        m = output.metrics
        if m is None:
            return
        if m.max_tokens:
            f.params_max_tokens.observe(m.max_tokens)
        if m.finish_time is not None:
            f.e2e.observe(max(m.finish_time - m.arrival_time, 0.0))
        if m.first_scheduled_time is not None:
            f.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
        if m.first_token_time is not None:
            self._observe_computed(output)

    def _observe_computed(self, output: RequestOutput) -> None:
        """The families of a request whose prompt was computed (it has a first token)."""
        f, m = self._families, output.metrics
        assert m is not None and m.first_token_time is not None
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        last = m.last_token_time if m.last_token_time is not None else m.first_token_time
        decode_s = max(last - m.first_token_time, 0.0)
        f.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
        f.prefill.observe(max(m.first_token_time - scheduled, 0.0))
        f.decode.observe(decode_s)
        f.inference.observe(max(last - scheduled, 0.0))
        # the metrics are those of the choice that finished last (delta_index), so are its tokens
        num_tokens = len(output.outputs[output.delta_index].token_ids) if output.outputs else 0
        f.request_tpot.observe(decode_s / (num_tokens - 1) if num_tokens > 1 else 0.0)
        for latency_s in m.inter_token_latencies_s:
            f.itl.observe(latency_s)
            f.tpot.observe(latency_s)
        cached = min(max(output.num_cached_tokens, 0), len(output.prompt_token_ids))
        computed = len(output.prompt_token_ids) - cached
        f.prefill_kv_computed.observe(computed)
        f.computed_tokens.inc(computed)
        f.cache_hit_tokens.inc(cached)
        f.cached_tokens.inc(cached)
