"""The routing simulation against a real two-replica server (benchmarks/routing_validate.py), on the tiny
checkpoint: costs measured here, the same small workload played on `mmserve serve --data-parallel-size 2`
and simulated, and the simulated hit rates within the stated error of the measured ones."""

from __future__ import annotations

import pytest

from benchmarks.routing_costs import ensure_costs
from benchmarks.routing_validate import MAX_RATE_ERROR, validate


@pytest.mark.slow
def test_simulated_hit_rates_match_a_real_two_replica_run(all_checkpoints, tmp_path):
    costs = ensure_costs(str(all_checkpoints["qwen2_vl"]), threads=1, path=tmp_path / "costs.json")
    result = validate(costs, log_dir=tmp_path)
    assert result["errors"]["image_reuse"] <= MAX_RATE_ERROR, result
    assert result["errors"]["prefix_hit_rate"] <= MAX_RATE_ERROR, result
    assert min(result["real"]["requests_per_replica"]) > 0, result  # both replicas served
    assert result["within_bounds"], result
