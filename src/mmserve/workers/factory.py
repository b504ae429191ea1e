"""Which backend runs the encoder workers: the one place that names both.

Role: `make_pool` starts the pool of a backend, `process` (local processes, tensors through shared
memory) or `ray` (Ray actors, imported only when asked for), from a `WorkerSpec`.

What it does not know: how either backend works, requests, the engine.
"""

from __future__ import annotations

from mmserve.config import ENCODER_BACKENDS
from mmserve.runner.encoder.pool import EncoderPool
from mmserve.workers.spec import WorkerSpec


def make_pool(backend: str, spec: WorkerSpec, num_workers: int, ray_address: str | None = None) -> EncoderPool:
    """The pool of `backend` ("process" or "ray"); Ray is imported only when asked for."""
    if backend == "process":
        from mmserve.workers.process_pool import ProcessEncoderPool

        return ProcessEncoderPool(spec, num_workers)
    if backend == "ray":
        from mmserve.workers.ray_pool import RayEncoderPool  # Ray is an optional extra

        return RayEncoderPool(spec, num_workers, ray_address=ray_address)
    raise ValueError(f"unknown encoder backend {backend!r}; one of {', '.join(ENCODER_BACKENDS)}")
