"""The environment variables mmserve reads, all of them, in one place.

Role: name each variable once and read it when asked (not at import), so a test or a user that sets
one before building an engine is heard. Engine behaviour is configured by `config.py`'s engine args;
what lives here is only what belongs to the machine rather than to an engine: where built kernels are
cached, which C++ compiler builds them, and the switch that keeps mmserve's native kernels off.

What it does not know: what the values are used for beyond their documentation.
"""

from __future__ import annotations

import os
from pathlib import Path

NATIVE_KERNELS = "MMSERVE_NATIVE_KERNELS"  # "0": never build or use mmserve's native CPU kernels
NATIVE_KERNELS_EARLIER_NAME = "MMSERVE_CPU_GEMM"  # the same switch's earlier name, still read
CACHE_DIR = "MMSERVE_CACHE_DIR"  # where built kernels are kept; default $XDG_CACHE_HOME/mmserve or ~/.cache/mmserve
CXX = "CXX"  # the C++ compiler that builds them (default g++, as TorchInductor's)


def native_kernels_enabled() -> bool:
    return os.environ.get(NATIVE_KERNELS, os.environ.get(NATIVE_KERNELS_EARLIER_NAME, "1")) != "0"


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR):
        return Path(os.environ[CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmserve"


def cxx_compiler_name() -> str:
    return os.environ.get(CXX, "g++")
