"""The harness the compile benchmarks share: each (setting, cache) case once per round in a fresh process,
in an order rotated each round; the warm TorchInductor cache filled first, off the record.

Role: `run_cases(module, cases, rounds, worker_args, describe)` starts `python -m <module> --worker SETTING
...` with `TORCHINDUCTOR_CACHE_DIR` set (a fresh empty directory for a "cold" case, the shared filled one
for "warm") and `MMSERVE_COMPILE_CPU_DECODE` set as the setting says (`SETTINGS`: `default` leaves it
unset, what a user gets), reads the worker's JSON line, and returns every run per case; `median_of` folds
them. A worker builds its engine with `compile_cpu_decode=SETTINGS[setting].kwarg`.

What it does not know: what a worker measures, mmserve.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.card import ROOT

Case = tuple[str, str]  # (setting, "cold" or "warm")


@dataclass(frozen=True)
class CompileSetting:
    kwarg: bool | None  # the engine's compile_cpu_decode
    env: str | None  # MMSERVE_COMPILE_CPU_DECODE (None: unset)


SETTINGS = {"default": CompileSetting(None, None),  # what a user gets: eager
            "off": CompileSetting(False, None),
            "startup": CompileSetting(True, None),  # compiled (or loaded from the cache) before serving
            "background": CompileSetting(None, "1")}  # compiled in a thread while serving eagerly


def _run_fresh(module: str, setting: str, cache_dir: str, worker_args: Sequence[str]) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env.pop("MMSERVE_COMPILE_CPU_DECODE", None)
    if SETTINGS[setting].env is not None:
        env["MMSERVE_COMPILE_CPU_DECODE"] = SETTINGS[setting].env
    cmd = [sys.executable, "-m", module, "--worker", setting, *worker_args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cases(module: str, cases: Sequence[Case], rounds: int, worker_args: Sequence[str],
              describe: Callable[[dict[str, Any]], str]) -> dict[str, list[dict[str, Any]]]:
    """Every case's results, keyed "setting/cache"; a line per run on stderr (`describe` words the result)."""
    runs: dict[str, list[dict[str, Any]]] = {f"{s}/{c}": [] for s, c in cases}
    warm_cache = tempfile.mkdtemp(prefix="mmserve-inductor-warm-")
    _run_fresh(module, "startup", warm_cache, worker_args)  # fills the warm cache, off the record
    for round_index in range(rounds):
        shift = round_index % len(cases)
        for setting, cache in [*cases[shift:], *cases[:shift]]:
            cache_dir = warm_cache if cache == "warm" else tempfile.mkdtemp(prefix="mmserve-inductor-cold-")
            result = _run_fresh(module, setting, cache_dir, worker_args)
            runs[f"{setting}/{cache}"].append(result)
            print(f"round {round_index + 1}: {setting:8s} {cache}: {describe(result)}", file=sys.stderr, flush=True)
    return runs


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None
