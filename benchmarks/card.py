"""What every benchmark prints the same way: the repository paths it writes under, the machine it ran
on, the card's title and `key : value` lines, and the one JSON line that comes last.

Role: one place for the card's shape, so a reader compares two benchmarks' cards line by line and a
script reads any benchmark's last line as JSON. What it does not know: any benchmark's workload,
model or measurements (they pass their own card lines and payload).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository: `.bench/` and `.peers/` live here
BENCH_DIR = ROOT / ".bench"  # checkpoints, logs and plots the benchmarks write (git-ignored)
LABEL_WIDTH = 10  # "machine   : ..." — the card's labels line up


def machine_info(threads: int | None = None, software: bool = True) -> dict[str, Any]:
    """The machine and, with `software`, the torch and transformers versions (imported only then, so an
    HTTP-only benchmark does not pay for torch)."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                            "platform": platform.platform(), "python": platform.python_version()}
    if software:
        import torch
        import transformers

        info |= {"torch": torch.__version__, "transformers": transformers.__version__}
    if threads is not None:
        info["torch_threads"] = threads
    return info


def machine_line(machine: dict[str, Any]) -> str:
    """The card's first line: '<n> usable CPUs (<m> total), <platform>, python <v>'."""
    return (f"{machine['usable_cpus']} usable CPUs ({machine['cpu_count']} total), {machine['platform']}, "
            f"python {machine['python']}")


def print_card(title: str, lines: dict[str, str]) -> None:
    """`== title ==`, then one aligned `label : text` line each, then a blank line."""
    print(f"== {title} ==")
    for label, text in lines.items():
        print(f"{label:<{LABEL_WIDTH}}: {text}")
    print()


def json_line(payload: dict[str, Any], compact: bool = False) -> None:
    """The benchmark's last line: its whole result as one JSON object."""
    print(json.dumps(payload, separators=(",", ":") if compact else None), flush=True)
