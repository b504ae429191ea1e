"""The environment variables mmserve reads, all of them, in one place.

Role: name each variable once and read it when asked (not at import), so a test or a user that sets
one before building an engine is heard. Engine behaviour is configured by `config.py`'s engine args;
what lives here is only what belongs to the machine rather than to an engine: where built kernels are
cached (and TorchInductor's compiled steps), which C++ compiler builds them, the switch that keeps
mmserve's native kernels off, the one that keeps the CPU's decode step from being compiled by default,
the one that leaves glibc's malloc untuned, and the one that allows a max_model_len past the checkpoint's positions (mmserve's name and vLLM's).

Hugging Face's own variables are read here too (`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`), at call
time, and handed to `huggingface_hub` as arguments: its constants are fixed when it is imported.

What it does not know: what the values are used for beyond their documentation.
"""

from __future__ import annotations

import os
from pathlib import Path

NATIVE_KERNELS = "MMSERVE_NATIVE_KERNELS"  # "0": never build or use mmserve's native CPU kernels
NATIVE_KERNELS_EARLIER_NAME = "MMSERVE_CPU_GEMM"  # the same switch's earlier name, still read
CACHE_DIR = "MMSERVE_CACHE_DIR"  # where built kernels are kept; default $XDG_CACHE_HOME/mmserve or ~/.cache/mmserve
# where TorchInductor keeps its caches (compiled decode steps); unset or Inductor's default (under /tmp):
# the "inductor" folder of CACHE_DIR (runner/cpu/compile.py points it there)
INDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
CXX = "CXX"  # the C++ compiler that builds them (default g++, as TorchInductor's)
# "1": engines that are not asked (compile_cpu_decode unset) compile the CPU's decode step in a background
# thread while they serve eagerly (a long-lived server that may pay a slower first minutes for a faster step
# later); unset or "0", the default: they run it eagerly. Measured (docs/performance.md, "Compile policy"):
# the compiling thread slows the steps served beside it at every core count (it shares the interpreter)
COMPILE_CPU_DECODE = "MMSERVE_COMPILE_CPU_DECODE"
# "1": a max_model_len above the checkpoint's positions (max_position_embeddings) is allowed, as vLLM's
# VLLM_ALLOW_LONG_MAX_MODEL_LEN allows it (read too, so a vLLM user's environment means the same here)
ALLOW_LONG_MAX_MODEL_LEN = "MMSERVE_ALLOW_LONG_MAX_MODEL_LEN"
VLLM_ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# "0": a CPU engine leaves glibc's malloc as it is; unset or "1", the default: it raises glibc's mmap and trim
# thresholds once per process, so a step's large tensors reuse heap memory instead of fresh pages
# (runner/cpu/malloc.py; measured in docs/performance.md)
CPU_MALLOC_TUNING = "MMSERVE_CPU_MALLOC_TUNING"


def native_kernels_enabled() -> bool:
    return os.environ.get(NATIVE_KERNELS, os.environ.get(NATIVE_KERNELS_EARLIER_NAME, "1")) != "0"


def compile_cpu_decode_by_default() -> bool:
    return os.environ.get(COMPILE_CPU_DECODE, "0") not in ("", "0")


def cpu_malloc_tuning_enabled() -> bool:
    return os.environ.get(CPU_MALLOC_TUNING, "1") != "0"


def allow_long_max_model_len() -> bool:
    return any(os.environ.get(name, "0").strip().lower() in ("1", "true")
               for name in (ALLOW_LONG_MAX_MODEL_LEN, VLLM_ALLOW_LONG_MAX_MODEL_LEN))


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR):
        return Path(os.environ[CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmserve"


def cxx_compiler_name() -> str:
    return os.environ.get(CXX, "g++")


def hf_hub_cache() -> Path:
    """Where Hugging Face keeps downloaded repositories (its default: $HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home) / "hub"


def hf_hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
