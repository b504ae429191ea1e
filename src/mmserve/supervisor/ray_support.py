"""Ray for mmserve's actors (encoder workers and replicas): imported when asked for, joined or started once.

Role: `init_ray` joins Ray at an address, uses it as is where this process already initialised it,
or starts it locally with enough CPUs for the actors asked for; `summary` shortens Ray's errors to
a line a log can carry.
What it does not know: what the actors run.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

from mmserve.errors import ModelLoadError

logger = logging.getLogger("mmserve.supervisor")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ModelLoadError("the ray backend needs Ray, which is not installed: pip install mmserve[ray]") from exc
    return ray


def init_ray(ray_address: str | None, cpus_needed: float) -> tuple[Any, bool]:
    """Ray, joined at `ray_address`, used as is where this process already initialised it, or else
    started locally; and whether this call started it (then its caller shuts it down)."""
    ray = import_ray()
    if ray.is_initialized():
        if ray_address is not None:
            logger.warning("Ray is already initialised in this process; ray_address=%s is not used", ray_address)
        return ray, False
    if ray_address is not None:
        ray.init(address=ray_address)
    else:
        # never fewer CPUs than the actors ask for: an actor Ray cannot place would wait forever;
        # oversubscribing cores is what local processes would do too
        cores = max(len(os.sched_getaffinity(0)), math.ceil(cpus_needed))
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    return ray, True


def summary(exc: BaseException) -> str:
    """Ray's errors carry whole tracebacks (with terminal colours): keep their first line and, when
    there is a traceback, its last one, the error raised in the actor."""
    lines = [ln.strip() for ln in _ANSI_ESCAPE.sub("", str(exc)).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
