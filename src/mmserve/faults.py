"""Faults a test plants in an engine, to see that each one fails only what it should.

Role: `FaultPlan` is handed to `Engine(config, faults=...)` (or `LLM(..., faults=...)`) by a test; the
engine passes each fault to the part it concerns. Production code never builds one: with no plan, no
fault hook runs and nothing is read from the environment.

What it does not know: which test plants what, or why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: a plan is plain values, importable anywhere
    from mmserve.runner.encoder.pool import EncoderPool
    from mmserve.runner.encoder.runner import EncodeFn


@dataclass(frozen=True)
class FaultPlan:
    # a model step whose batch holds this token id raises (after the batch is built, before the forward)
    step_fault_token_id: int | None = None
    # an encoder worker of the first generation exits hard when handed an item with this content key
    encoder_worker_dies_on_key: str | None = None
    # wraps the inline encoder's function (payloads -> outputs): a failing or corrupting encoder
    wrap_encode: Callable[[EncodeFn], EncodeFn] | None = None
    # the pool the engine uses instead of starting `encoder_workers` workers (e.g. one whose workers are gone)
    encoder_pool: Callable[[], EncoderPool] | None = None
