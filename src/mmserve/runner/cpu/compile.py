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

Known limit: Inductor's own tables (its generated modules, their graphs) keep the frozen weights
alive after the caller is gone, until the process exits. A process builds one compiled engine.

What it does not know: what the step computes, buckets, the KV cache.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config

_FREEZING = {"freezing": True, "cpp.weight_prepack": False, "emulate_precision_casts": True}


def frozen_compile(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    owner, fn = step.__self__, step.__func__  # type: ignore[attr-defined]
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(types.MethodType(own, owner), options={"guard_filter_fn": _keep_guards})

    def run(*args: Any) -> torch.Tensor:
        with torch._inductor.config.patch(_FREEZING), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return compiled(*args)
    return run


def _keep_guards(entries: list) -> list[bool]:
    return [e.guard_type == "ID_MATCH" or not e.orig_guard.source.is_unspecialized_nn_module() for e in entries]
