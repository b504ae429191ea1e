"""mmserve's own float32 CPU matmul for the language model: `PanelLinear` over `kernels/panel_gemm.cpp`.

Role: build the kernel once per machine (the C++ compiler that TorchInductor uses, flags for AVX2 and
FMA, OpenMP from the library PyTorch already loaded), cache the shared library under the user's
cache directory keyed by the source and the flags, load it with ctypes, and run linear layers on
weights re-stored once in its panel layout (`kernels/panel_gemm.cpp` says why it is faster). The
building, caching and loading (`build`, `built_library`, `cached_library`) serve every kernel of
`kernels/`; `cpu_attention` loads its own the same way.

Measured on the 2-core AVX2 bench machine against oneDNN's linear on its own packed weights (what
`cpu_layout.PackedLinear` runs), median of 30 calls: the 100m model's head (32 rows x 640 x 32000)
10.3 -> 7.6 ms, its MLP up-projection (32 x 640 x 3456) 0.96 -> 0.77 ms, the head at one row 2.4 ->
1.8 ms; at 2464 rows (a prefill) 78 -> 74 ms. The products differ from `F.linear`'s in the last bits
(another summation order) and do not depend on which rows share a batch.

Under `torch.compile` the product is the operator `mmserve::panel_linear` (opaque to the compiler);
eager calls go to the library directly.

What it does not know: models, the engine, other dtypes or devices (`cpu_layout` hands it float32 CPU
layers only; `available()` says whether this machine can run it at all).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "panel_gemm.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
CACHE_ENV = "MMSERVE_CACHE_DIR"  # where built kernels are kept; default: $XDG_CACHE_HOME/mmserve or ~/.cache/mmserve
DISABLE_ENV = "MMSERVE_CPU_GEMM"  # "0": never build or use mmserve's CPU kernels (oneDNN's linear, SDPA then)
PANEL_COLUMNS = 16  # output columns per panel: kernels/panel_gemm.cpp's kCols


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmserve"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_supports_kernel() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build(compiler: str, target_dir: Path, source: Path = SOURCE) -> Path:
    """Compile `source` (a file of `kernels/`) into `target_dir`, as a file named by the hash of source,
    flags and compiler; an existing build is reused. Concurrent builders each write a temporary file and
    rename it."""
    code = source.read_bytes()
    key = hashlib.sha256(code + " ".join(FLAGS).encode() + compiler.encode()).hexdigest()[:16]
    target = target_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], check=True, capture_output=True,
                       timeout=300)
        os.replace(built, target)
    return target


def built_library(source: Path, fallback: str) -> Path | None:
    """The built library of `source`, or None where mmserve's CPU kernels cannot run (no AVX2/FMA, no
    compiler, switched off by `MMSERVE_CPU_GEMM=0`, a failed build: logged, naming `fallback`, what runs
    instead)."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or not _cpu_supports_kernel():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C++ compiler found: %s", fallback)
        return None
    try:
        return build(compiler, cache_dir() / "kernels", source)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("building %s failed (%s%s); %s", source.name, exc,
                       (": " + detail.decode(errors="replace")[-500:]) if detail else "", fallback)
        return None


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


class PanelKernel:
    """The loaded library: packing and the product, on raw pointers (shapes checked by the callers)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.mm_panel_floats.argtypes, lib.mm_panel_floats.restype = [i64, i64], i64
        lib.mm_pack_panels.argtypes, lib.mm_pack_panels.restype = [ptr, ptr, i64, i64], None
        lib.mm_panel_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
        lib.mm_panel_gemm.restype = None
        self.path = path
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(N, K) float32 -> the panels, a flat float32 tensor."""
        weight = weight.detach().contiguous()
        n, k = weight.shape
        panels = torch.empty(self._lib.mm_panel_floats(n, k), dtype=torch.float32)
        self._lib.mm_pack_panels(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def linear(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        if rows.shape[0]:
            self._lib.mm_panel_gemm(rows.data_ptr(), rows.shape[0], k, rows.stride(0), panels.data_ptr(), out_features,
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                    torch.get_num_threads())
        return out.view(*x.shape[:-1], out_features)


# the kernel, or None where it cannot run; callers then keep oneDNN's linear
kernel = cached_library(SOURCE, "the language model's float32 linears stay on oneDNN", PanelKernel)


def available() -> bool:
    return kernel() is not None


def _panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    lib = kernel()
    assert lib is not None, "mmserve::panel_linear runs only where the kernel was built"
    return lib.linear(x, panels, bias, out_features)


def _panel_linear_fake(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                       out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


# The product as an operator, for compiled steps. Defined on a `torch.library.Library` with a CPU kernel
# rather than with `torch.library.custom_op`, whose wrapper measured 25 us a call against 18 (41 calls
# a step on the 100m model); the library lives as long as the module.
_LIBRARY = torch.library.Library("mmserve", "FRAGMENT")
_LIBRARY.define("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl("panel_linear", _panel_linear, "CPU")
torch.library.register_fake("mmserve::panel_linear", _panel_linear_fake, lib=_LIBRARY)


class PanelLinear(nn.Module):
    """A float32 CPU linear layer on mmserve's panel kernel. `weight` gives a dense (out, in) copy, for
    inspection only: the product never reads it."""

    def __init__(self, linear: nn.Linear, lib: PanelKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("panels", lib.pack(linear.weight), persistent=False)
        self.bias = linear.bias
        self._lib = lib

    @property
    def weight(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        return self.panels.view(-1, k, PANEL_COLUMNS).permute(0, 2, 1).reshape(-1, k)[:n].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.mmserve.panel_linear(x, self.panels, self.bias, self.out_features)
        if torch.autograd._profiler_enabled():  # named in a profile as the compiled op is; no cost otherwise
            with torch.profiler.record_function("mmserve::panel_linear"):
                return self._lib.linear(x, self.panels, self.bias, self.out_features)
        return self._lib.linear(x, self.panels, self.bias, self.out_features)
