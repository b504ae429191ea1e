"""Shared by the encoder-pool tests: wait for a pool's outcomes."""

from __future__ import annotations

import time


def collect(pool, keys, timeout_s: float, interval_s: float = 0.01) -> dict:
    """key -> ItemOutcome for every key, polling until they are all back (each exactly once)."""
    got: dict = {}
    deadline_s = time.monotonic() + timeout_s
    while set(keys) - got.keys():
        assert time.monotonic() < deadline_s, f"{len(set(keys) - got.keys())} items never came back"
        for outcome in pool.poll():
            assert outcome.key not in got, "an outcome came back twice"
            got[outcome.key] = outcome
        time.sleep(interval_s)
    return got
