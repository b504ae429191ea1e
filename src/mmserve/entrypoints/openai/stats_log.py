"""The server's periodic stats line, as vLLM logs it (every 10 s, off with `--disable-log-stats`).

Role: `StatsLine.after(stats, elapsed_s)` turns two snapshots of the engine's stats (`EngineClient.stats()`)
into one line: prompt and generation throughput over the interval, requests running and waiting, KV cache
usage, the prefix cache's hit rate; with speculative decoding a second line: the interval's mean acceptance
length (vLLM's: 1 + accepted / drafts), accepted and drafted tokens per second, and the acceptance rate at
each draft position. None while nothing happened. `log_stats_every(client, interval_s, sleep)` is the
lifespan's task: it sleeps through the injected `sleep` (tests pass their own) and logs each line.
What it does not know: the engine's internals (only the stats dict's keys), HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("mmserve.stats")

LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL
COUNTERS = ("prompt_tokens_computed", "generation_tokens", "prefix_cache_hit_tokens", "prefix_cache_queries",
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@dataclass
class StatsLine:
    previous: dict[str, Any] = field(default_factory=dict)

    def after(self, stats: Mapping[str, Any], elapsed_s: float) -> list[str]:
        """The lines for the interval of `elapsed_s` seconds that ends with `stats` ([]: nothing happened)."""
        delta = {key: stats.get(key, 0) - self.previous.get(key, 0) for key in COUNTERS}
        positions = sorted(key for key in stats if key.startswith("spec_decode_num_accepted_tokens_per_pos_"))
        per_position = [stats[key] - self.previous.get(key, 0) for key in positions]
        self.previous = dict(stats)
        busy = stats.get("requests_running", 0) or stats.get("requests_waiting", 0)
        if not busy and not delta["prompt_tokens_computed"] and not delta["generation_tokens"]:
            return []
        seconds = max(elapsed_s, 1e-9)
        total = stats.get("kv_blocks_total", 0)
        usage = 0.0 if not total else 100.0 * (total - stats.get("kv_blocks_free", 0)) / total
        queries = delta["prefix_cache_queries"]
        hit_rate = 0.0 if not queries else 100.0 * delta["prefix_cache_hit_tokens"] / queries
        lines = [f"Avg prompt throughput: {delta['prompt_tokens_computed'] / seconds:.1f} tokens/s, "
                 f"Avg generation throughput: {delta['generation_tokens'] / seconds:.1f} tokens/s, "
                 f"Running: {stats.get('requests_running', 0)} reqs, Waiting: {stats.get('requests_waiting', 0)} reqs, "
                 f"KV cache usage: {usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"]
        drafts = delta["spec_decode_num_drafts"]
        if drafts:
            accepted = delta["spec_decode_num_accepted_tokens"]
            rates = ", ".join(f"{n / drafts:.3f}" for n in per_position)
            lines.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                         f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
                         f"Drafted throughput: {delta['spec_decode_num_draft_tokens'] / seconds:.2f} tokens/s, "
                         f"Accepted: {accepted} tokens, Drafted: {delta['spec_decode_num_draft_tokens']} tokens, "
                         f"Per-position acceptance rate: {rates}, Avg Draft acceptance rate: "
                         f"{100.0 * accepted / max(delta['spec_decode_num_draft_tokens'], 1):.1f}%")
        return lines


async def log_stats_every(stats: Callable[[], Mapping[str, Any]], interval_s: float,
                          sleep: Callable[[float], Awaitable[None]], clock: Callable[[], float] = time.monotonic,
                          ) -> None:
    """Log the stats lines every `interval_s` until cancelled."""
    line, last = StatsLine(dict(stats())), clock()
    while True:
        await sleep(interval_s)
        now = clock()
        for text in line.after(stats(), now - last):
            logger.info(text)
        last = now
