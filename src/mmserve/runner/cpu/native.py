"""Build, cache and load mmserve's native CPU kernels (the C++ sources in `kernels/`).

Role: compile a kernel source once per machine with the C++ compiler TorchInductor uses (flags for
AVX2 and FMA, plus AVX-512, its BF16 and VNNI extensions and AMX tiles where this CPU has them:
`isa_flags`; OpenMP from the library PyTorch already loaded), keep the shared library under the
user's cache directory named by the source, the headers beside it, flags and compiler, and hand it to
a loader once per process. A kernel source picks its code paths from the compiler's macros
(`__AVX512F__`, `__AMX_BF16__`, `__AMX_INT8__`), so one source serves every machine and the library
built here uses what this CPU has. Where a kernel cannot run (no AVX2/FMA, no compiler, a failed
build, or switched off with
`MMSERVE_NATIVE_KERNELS=0`) the loader gets nothing and the caller keeps its fallback; the reason is
logged once. One switch serves every kernel: a machine either builds mmserve's kernels or it does not.
`built_kernels()` says, for this process, which sources were asked for and what became of each (how a
test sees that an installed wheel's sources built, rather than a fallback running).

What it does not know: what a kernel computes, models, the engine.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from mmserve import envs

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent / "kernels"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
AVX2_FLAGS = ("-mavx2", "-mfma")  # every machine the kernels run on
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")  # ATen's AVX512 level
AVX512_BF16_FLAGS = ("-mavx512bf16",)
AVX512_VNNI_FLAGS = ("-mavx512vnni",)
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mamx-int8")
BUILD_TIMEOUT_S = 300
_BUILT: dict[str, Path | None] = {}  # source file name -> its library, or None where the fallback runs


def _compiler() -> str | None:
    return shutil.which(envs.cxx_compiler_name())


def _cpu_supports_kernels() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cpu_has(feature: str) -> bool:
    probe = getattr(torch.cpu, f"_is_{feature}_supported", None)  # torch's own CPUID reading
    return bool(probe is not None and probe())


@functools.cache
def isa_flags() -> tuple[str, ...]:
    """The instruction-set flags this CPU's builds get: AVX2 and FMA, and AVX-512 (with BF16, VNNI and
    AMX's bfloat16 and int8 tiles where present) when PyTorch itself runs its AVX512 kernels here."""
    flags = AVX2_FLAGS
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        flags += AVX512_FLAGS
        bf16 = _cpu_has("avx512_bf16")
        flags += AVX512_BF16_FLAGS if bf16 else ()
        flags += AVX512_VNNI_FLAGS if _cpu_has("vnni") else ()
        flags += AMX_FLAGS if bf16 and _cpu_has("amx_tile") else ()
    return flags


def build(compiler: str, target_dir: Path, source: Path, isa: tuple[str, ...] | None = None) -> Path:
    """Compile `source` into `target_dir` for the instruction sets `isa` (default: this CPU's,
    `isa_flags()`), as a file named by the hash of source, the headers beside it, flags and compiler;
    an existing build is reused. Concurrent builders each write a temporary file and rename it."""
    flags = (*FLAGS, *(isa_flags() if isa is None else isa))
    code = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(code + " ".join(flags).encode() + compiler.encode()).hexdigest()[:16]
    target = target_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("building the native kernel %s (once per machine) ...", source.name)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True,
                       timeout=BUILD_TIMEOUT_S)
        os.replace(built, target)
    logger.info("built %s in %.1f s, cached in %s", source.name, time.perf_counter() - started, target_dir)
    return target


def built_library(source: Path, fallback: str) -> Path | None:
    """The built library of `source`, or None where mmserve's native kernels cannot run (see the module
    docstring; logged, naming `fallback`, what runs instead)."""
    _BUILT[source.name] = path = _built_library(source, fallback)
    return path


def _built_library(source: Path, fallback: str) -> Path | None:
    if not envs.native_kernels_enabled() or not _cpu_supports_kernels():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C++ compiler found: %s", fallback)
        return None
    try:
        return build(compiler, envs.cache_dir() / "kernels", source)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("building %s failed (%s%s); %s", source.name, exc,
                       (": " + detail.decode(errors="replace")[-500:]) if detail else "", fallback)
        return None


def built_kernels() -> dict[str, Path | None]:
    """The kernel sources this process has asked for (file names), each with the library built from it, or
    None where its fallback runs (switched off, no compiler, an unsuited CPU, a failed build: logged)."""
    return dict(_BUILT)


Loaded = TypeVar("Loaded")


def cached_library(source: Path, fallback: str, load: Callable[[Path], Loaded]) -> Callable[[], Loaded | None]:
    """A function returning `load(built library of source)`, or None where it cannot run (`built_library`):
    one build and one load per process, the library being immutable once loaded (`cache_clear()` on the
    function makes it decide anew, for tests)."""
    @functools.cache
    def loaded() -> Loaded | None:
        path = built_library(source, fallback)
        return None if path is None else load(path)
    return loaded
