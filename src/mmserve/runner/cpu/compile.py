"""A step compiled by TorchInductor for the CPU, its weights frozen in, its compiled code its own.

Role: `frozen_compile(bound_method)` returns a callable that runs the method compiled. What it takes
care of, each measured or seen failing without it:
- **Frozen weights.** Inductor lowers oneDNN's packed linears only with their weights as constants,
  so the step is compiled with freezing. Freezing is read while the step is traced, so it is set
  around every call that may trace, not process-wide. No prepacked copies of weights (the packed
  linears already are; a tied head's table would be copied per graph).
- **Its own code object.** Dynamo keeps compiled graphs on the code object: shared by every engine in
  the process, a second engine reused graphs holding the first one's frozen weights (wrong tokens).
  The method runs on a fresh copy of its code object, owned by the caller and freed with it.
- **No automatic dynamic shapes.** Dynamo remembers sizes per function name across code objects; a
  second engine's compile then turned dims dynamic that the first saw static and produced wrong
  code. Dims are dynamic only where the caller marks them (`torch._dynamo.mark_dynamic`).
- **Eager's roundings.** In bfloat16, Inductor's fused loops would keep intermediate results in float32
  where the eager ops round each to bfloat16 (`emulate_precision_casts` rounds them as eager does), so
  a compiled step's numbers are the eager step's, not merely close (greedy tokens flipped without it).
- **Fewer guards.** The guards on the modules' structure are dropped (checking them is a visible share
  of a small decode step); those on the weights' identity stay. The engine never changes weights after loading.

- **Stoppable.** Inductor compiles a graph's C++ kernels on a thread pool of its own and waits for them all;
  `cancel_pending_compiles` cancels the queued ones, so a stopped compile ends once the kernels in flight
  (at most `compile_threads`) are built, not after every kernel of the graph.
- **No broken library kept.** A compiler ended by a signal (Ctrl-C in a terminal reaches the compiler
  processes too; a stopped compile ends them) can leave a truncated library in the cache, which the
  next start would load and fail on ("file too short") for good. `drop_failed_build_outputs` removes
  what a failed build wrote and a cached library that failed to load, so the next compile rebuilds it.
- **Cached on disk.** Inductor's caches (its FX graph cache keeps frozen graphs too) live in mmserve's
  cache directory (`use_mmserve_cache_dir`), not under /tmp: a second start loads the compiled steps
  and runs no compiler.

Known limit: Inductor's own tables (its generated modules, their graphs) keep the frozen weights
alive after the caller is gone, until the process exits. A process builds one compiled engine.

What it does not know: what the step computes, buckets, the KV cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config

from mmserve import envs

_FREEZING = {"freezing": True, "cpp.weight_prepack": False, "emulate_precision_casts": True}


def frozen_compile(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    use_mmserve_cache_dir()
    owner, fn = step.__self__, step.__func__  # type: ignore[attr-defined]
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(types.MethodType(own, owner), options={"guard_filter_fn": _keep_guards})

    def run(*args: Any) -> torch.Tensor:
        with torch._inductor.config.patch(_FREEZING), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return compiled(*args)
    return run


def _keep_guards(entries: list) -> list[bool]:
    return [e.guard_type == "ID_MATCH" or not e.orig_guard.source.is_unspecialized_nn_module() for e in entries]


def use_mmserve_cache_dir() -> None:
    """Point Inductor's caches at mmserve's cache directory, unless the user chose theirs
    (TORCHINDUCTOR_CACHE_DIR). Importing Inductor already sets the variable to its default (under /tmp),
    so that value counts as not chosen; Inductor reads the variable again at each cache lookup."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get(envs.INDUCTOR_CACHE_DIR) in (None, "", os.path.abspath(default_cache_dir())):
        os.environ[envs.INDUCTOR_CACHE_DIR] = str(envs.cache_dir() / "inductor")


def cancel_pending_compiles() -> None:
    """Cancel the C++ kernel builds Inductor has queued and end those running (a compiler process of this
    one whose command line writes into Inductor's cache; its output file is removed, so the cache never
    holds half a library): a compile waiting on them fails at once, and the process can exit without
    waiting for a build. The next compile gets a fresh pool."""
    from torch._inductor.async_compile import AsyncCompile

    if AsyncCompile.pool.cache_info().currsize:
        AsyncCompile.pool().shutdown(wait=False, cancel_futures=True)
        AsyncCompile.pool.cache_clear()
    cache = os.environ.get(envs.INDUCTOR_CACHE_DIR)
    for pid in _child_pids(os.getpid()) if cache else ():
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if any(cache in arg for arg in cmd):
                os.kill(pid, signal.SIGTERM)
                # its output may be left half-written (the compiler's linker is not ended with it)
                drop_failed_build_outputs(subprocess.CalledProcessError(-signal.SIGTERM, cmd))


def forget_unfinished_builds() -> None:
    """Drop Inductor's in-process table of C++ builds (what it built is loaded again from its disk cache):
    a build a stopped compile cancelled stays there as a failed future, and the next compile of the same
    kernel (a second engine in the process) would fail on it. Called only while no compile runs."""
    from torch._inductor.codecache import CppCodeCache, CppPythonBindingsCodeCache, CppWrapperCodeCache

    for table in (CppCodeCache, CppPythonBindingsCodeCache, CppWrapperCodeCache):
        table.cache_clear()


def _exception_chain(error: BaseException) -> list[BaseException]:
    """`error` and what it wraps (Inductor wraps the compiler's failure in its own exceptions)."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return chain


def compiler_interrupted(error: BaseException) -> bool:
    """A compiler process in `error`'s chain was ended by a signal (stopped, not a failure of the code)."""
    return any(isinstance(e, subprocess.CalledProcessError) and e.returncode < 0 for e in _exception_chain(error))


def drop_failed_build_outputs(error: BaseException) -> list[Path]:
    """Remove from Inductor's cache what the failure in `error` may have left half-written: the output of
    each failed compiler command (`-o PATH`) and a cached library that failed to load. Returns the files
    removed; a file outside the cache is never touched."""
    cache = os.environ.get(envs.INDUCTOR_CACHE_DIR)
    if not cache:
        return []
    suspects: list[str] = []
    for e in _exception_chain(error):
        cmd = getattr(e, "cmd", None)
        if isinstance(cmd, list) and "-o" in cmd[:-1]:
            suspects.append(cmd[cmd.index("-o") + 1])
        if isinstance(e, ImportError):
            suspects += re.findall(re.escape(cache.rstrip("/")) + r"/\S+?\.so\b", str(e))
    removed: list[Path] = []
    for name in dict.fromkeys(suspects):
        path = Path(name).resolve()
        if path.is_relative_to(Path(cache).resolve()) and path.is_file():
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def _child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (Linux; none elsewhere)."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += map(int, children.read_text().split())
    return found


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) of Inductor's FX graph cache in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
