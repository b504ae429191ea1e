"""The routing simulation against a real two-replica server (`python -m benchmarks.cluster.routing_validate`,
run as the command it is), on the tiny checkpoint: costs measured here, the same small workload played on
`mmserve serve --data-parallel-size 2` and simulated, and the simulated hit rates within the stated error
of the measured ones (the benchmark's own bound, which its JSON line reports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_simulated_hit_rates_match_a_real_two_replica_run(all_checkpoints, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.cluster.routing_validate", "--model", str(all_checkpoints["qwen2_vl"]),
           "--threads", "1", "--costs", str(tmp_path / "costs.json"), "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    max_rate_error = result["bounds"]["rates_abs"]
    assert max_rate_error <= 0.1, result  # the bound the simulator is held to (MAX_RATE_ERROR)
    assert result["errors"]["image_reuse"] <= max_rate_error, result
    assert result["errors"]["prefix_hit_rate"] <= max_rate_error, result
    assert min(result["real"]["requests_per_replica"]) > 0, result  # both replicas served
    assert result["within_bounds"], result
