"""A short soak of the demo-model server: 32 concurrent clients for 60 s (`benchmarks/soak.py`).

Plain and streaming questions about shapes pictures drawn from a small pool (images repeat), fresh
pictures (encoded under load, with a small encoder cache that must evict), clients
that hang up after the first streamed chunk, and bad inputs. The server must never answer 5xx, every
answer must be the ground truth, every bad input must get a 4xx, and afterwards the engine must be
idle: no requests, every KV block free, no encoder-cache bytes referenced. RSS growth is reported but
not checked here: a minute is warm-up (a 10-minute run of `benchmarks/soak.py` is where it is judged).
`MMSERVE_SOAK_S` shortens or lengthens the run for local debugging.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.soak import KINDS, SoakConfig, run_soak

DURATION_S = float(os.environ.get("MMSERVE_SOAK_S", "60"))
# room for about 44 of the demo model's image outputs (~11.5 KB each), fewer than the pool's 48 pictures;
# half of it may be referenced by requests in flight at once, so some wait for the budget
ENCODER_CACHE_BYTES = 512 * 1024


@pytest.mark.slow
def test_soak_32_clients_no_5xx_no_wrong_answers_idle_after(tmp_path):
    log = tmp_path / "soak-server.log"
    # an encoder cache far smaller than the default, so fresh pictures push the pool's out and they are
    # encoded again under load (the answers must stay right)
    config = SoakConfig(clients=32, duration_s=DURATION_S, bucket_s=min(60.0, DURATION_S),
                        server_args=("--encoder-cache-bytes", str(ENCODER_CACHE_BYTES),
                                     "--encoder-output-budget-bytes", str(ENCODER_CACHE_BYTES // 2)))
    report = run_soak(config, log)
    context = f"{report.summary()}\nserver log:\n{log.read_text(errors='replace')[-4000:]}"
    assert report.server_errors_5xx == 0, context
    assert report.errors_by_status == {}, context  # no unexpected status, no timeout, no malformed body
    assert report.wrong_answers == 0, context
    assert report.idle_after, context
    assert report.idle_stats["kv_blocks_free"] == report.idle_stats["kv_blocks_total"], context
    assert report.idle_stats["encoder_cache_bytes_referenced"] == 0, context
    # every kind of request happened, and each was handled as it should be
    assert all(report.by_kind[kind] > 0 for kind in KINDS), context
    assert report.disconnects == report.by_kind["disconnect"], context
    assert report.bad_inputs_refused == report.by_kind["bad_input"], context
    # the pool keeps what the server answers right alone; the demo model is ~98% right, so losing more
    # than a tenth of the pool would be a serving fault that the under-load check cannot see
    assert report.pool_kept >= 0.9 * report.config.pool_size, context
    assert report.encoder_cache["encoder_cache_hits"] > 0, context  # images repeated
    assert report.encoder_cache["encoder_cache_misses"] > 0, context  # fresh pictures were encoded
    assert report.encoder_cache["encoder_cache_evictions"] > 0, context  # and the byte bound was reached
    assert report.rss_mib_first is not None and report.rss_mib_last is not None, context
