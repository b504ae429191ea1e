"""A short soak of the demo-model server: 32 concurrent clients for 30 s (`python -m benchmarks.server.soak`,
run as the command it is; its last line, the whole report as JSON, is judged here).

Plain and streaming questions about shapes pictures drawn from a small pool (images repeat), fresh
pictures (encoded under load, with a small encoder cache that must evict), clients
that hang up after the first streamed chunk, and bad inputs. The server must never answer 5xx, every
answer must be the ground truth, every bad input must get a 4xx, and afterwards the engine must be
idle: no requests, every KV block free, no encoder-cache bytes referenced. RSS growth is reported but
not checked here: half a minute is warm-up (a 10-minute run of the soak benchmark is where it is judged).
`MMSERVE_SOAK_S` shortens or lengthens the run for local debugging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DURATION_S = float(os.environ.get("MMSERVE_SOAK_S", "30"))
KINDS = ("plain", "stream", "fresh", "disconnect", "bad_input")  # every kind of request the soak sends
# room for about 44 of the demo model's image outputs (~11.5 KB each), fewer than the pool's 48 pictures;
# half of it may be referenced by requests in flight at once, so some wait for the budget
ENCODER_CACHE_BYTES = 512 * 1024


def run_soak(log: Path) -> dict:
    # an encoder cache far smaller than the default, so fresh pictures push the pool's out and they are
    # encoded again under load (the answers must stay right)
    server_args = f"--encoder-cache-bytes {ENCODER_CACHE_BYTES} --encoder-output-budget-bytes {ENCODER_CACHE_BYTES // 2}"
    cmd = [sys.executable, "-m", "benchmarks.server.soak", "--clients", "32", "--minutes", str(DURATION_S / 60.0),
           f"--server-args={server_args}", "--log", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\nserver log:\n{log.read_text(errors='replace')[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_soak_32_clients_no_5xx_no_wrong_answers_idle_after(tmp_path):
    log = tmp_path / "soak-server.log"
    report = run_soak(log)
    context = f"{report}\nserver log:\n{log.read_text(errors='replace')[-4000:]}"
    assert report["server_errors_5xx"] == 0, context
    assert report["errors_by_status"] == {}, context  # no unexpected status, no timeout, no malformed body
    assert report["wrong_answers"] == 0, context
    assert report["idle_after"], context
    assert report["idle_stats"]["kv_blocks_free"] == report["idle_stats"]["kv_blocks_total"], context
    assert report["idle_stats"]["encoder_cache_bytes_referenced"] == 0, context
    # every kind of request happened, and each was handled as it should be
    assert set(report["by_kind"]) == set(KINDS), context
    assert all(report["by_kind"][kind] > 0 for kind in KINDS), context
    assert report["disconnects"] == report["by_kind"]["disconnect"], context
    assert report["bad_inputs_refused"] == report["by_kind"]["bad_input"], context
    # the pool keeps what the server answers right alone; the demo model is ~98% right, so losing more
    # than a tenth of the pool would be a serving fault that the under-load check cannot see
    assert report["pool_kept"] >= 0.9 * report["config"]["pool_size"], context
    assert report["encoder_cache"]["encoder_cache_hits"] > 0, context  # images repeated
    assert report["encoder_cache"]["encoder_cache_misses"] > 0, context  # fresh pictures were encoded
    assert report["encoder_cache"]["encoder_cache_evictions"] > 0, context  # and the byte bound was reached
    assert report["rss_mib_first"] is not None and report["rss_mib_last"] is not None, context
