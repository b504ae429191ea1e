"""What an encoder worker is built from.

Role: `WorkerSpec` is all a worker needs (checkpoint, dtype, device, threads, a test's fault);
`build_encoder` runs inside a worker: it loads the family model, drops its language model and
returns its `encode_items`. Both backends' pools and workers read it; `factory.py` picks the backend.
Workers keep no request state: a worker may die at any time and lose nothing the engine needs.

What it does not know: requests, scheduling, the engine, which backend runs the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.runner.encoder.runner import EncodeFn
from mmserve.supervisor.restarts import RestartPolicy

MAX_RESTARTS_PER_MINUTE = 3  # per worker slot
# a dead worker's slot gets a new one at once, at most MAX_RESTARTS_PER_MINUTE times a minute
WORKER_RESTART_POLICY = RestartPolicy(window_s=60.0, max_restarts_per_window=MAX_RESTARTS_PER_MINUTE)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its encoder."""

    model_dir: str
    dtype: str  # "float32", "bfloat16", ...
    device: str  # torch device of the worker's encoder
    threads: int  # torch threads in the worker
    die_on_key: str | None = None  # a test's fault (FaultPlan): a first-generation worker exits hard on this key


def build_encoder(spec: WorkerSpec) -> EncodeFn:
    """In a worker: load the family model, drop its language model, return its `encode_items`."""
    from mmserve.models.loader import load_model  # in the worker only: the engine's process has its own
    from mmserve.runner.cpu.layout import prepare_for_cpu

    torch.set_num_threads(spec.threads)
    model = load_model(spec.model_dir, spec.dtype, spec.device)
    model.drop_language_model()
    prepare_for_cpu(model)  # the engine's own encoder gets the same kernels: outputs match wherever it runs

    @torch.inference_mode()
    def encode(payloads: Sequence[object]) -> list[torch.Tensor]:
        return [out.to("cpu") for out in model.encode_items(payloads)]
    return encode
