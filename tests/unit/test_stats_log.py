"""The server's periodic stats lines: throughput over the interval, queue, KV usage, the prefix cache's hit rate,
and with speculative decoding the mean acceptance length and each position's acceptance rate; nothing while idle;
the lifespan's task logs them on its injected sleep."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mmserve.entrypoints.openai.stats_log import StatsLine, log_stats_every

BASE = {"requests_running": 0, "requests_waiting": 0, "prompt_tokens_computed": 0, "generation_tokens": 0,
        "prefix_cache_hit_tokens": 0, "prefix_cache_queries": 0, "kv_blocks_total": 100, "kv_blocks_free": 100}
SPEC = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
        "spec_decode_num_accepted_tokens_per_pos_0": 0, "spec_decode_num_accepted_tokens_per_pos_1": 0}


def test_an_interval_line_with_speculation_and_none_when_idle():
    line = StatsLine(dict(BASE, **SPEC))
    busy = {**BASE, **SPEC} | dict(requests_running=2, prompt_tokens_computed=500, generation_tokens=200,
                prefix_cache_hit_tokens=100, prefix_cache_queries=400, kv_blocks_free=75, spec_decode_num_drafts=40,
                spec_decode_num_draft_tokens=80, spec_decode_num_accepted_tokens=60,
                spec_decode_num_accepted_tokens_per_pos_0=36, spec_decode_num_accepted_tokens_per_pos_1=24)
    first, spec = line.after(busy, 10.0)
    assert "Avg prompt throughput: 50.0 tokens/s" in first and "Avg generation throughput: 20.0 tokens/s" in first
    assert "Running: 2 reqs" in first and "KV cache usage: 25.0%" in first and "Prefix cache hit rate: 25.0%" in first
    assert "Mean acceptance length: 2.50" in spec  # 1 + 60 accepted / 40 drafts
    assert "Per-position acceptance rate: 0.900, 0.600" in spec and "Avg Draft acceptance rate: 75.0%" in spec
    idle = dict(busy, requests_running=0)
    assert line.after(idle, 10.0) == []  # no new tokens, nothing queued
    plain = StatsLine(dict(BASE)).after(dict(BASE, generation_tokens=5), 1.0)
    assert len(plain) == 1  # no speculation: no second line


def test_the_task_logs_on_its_sleep_until_cancelled(caplog):
    snapshots = iter([dict(BASE), dict(BASE, generation_tokens=30, requests_running=1)])
    times = iter([0.0, 3.0])
    sleeps = []

    async def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) > 1:
            raise asyncio.CancelledError

    with caplog.at_level(logging.INFO, logger="mmserve.stats"), pytest.raises(asyncio.CancelledError):
        asyncio.run(log_stats_every(lambda: next(snapshots), 10.0, sleep, clock=lambda: next(times)))
    assert sleeps == [10.0, 10.0]
    assert any("Avg generation throughput: 10.0 tokens/s" in r.message for r in caplog.records)
