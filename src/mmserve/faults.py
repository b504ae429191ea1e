"""Faults a test plants in an engine, to see that each one fails only what it should.

Role: `FaultPlan` is handed to `Engine(config, faults=...)` (or `LLM(..., faults=...)`) by a test; the
engine passes each fault to the part it concerns. Production code never builds one: with no plan, no
fault hook runs and nothing is read from the environment.

A leaf: it imports nothing of mmserve. The hooks are plain values whose shapes are stated here without
the runner's types; the runner and the engine consume them (`runner/model_runner.py` wraps its encode
function, `engine/llm_engine.py` starts the planted pool and hands the dying key to its workers).

What it does not know: which test plants what, or why; tensors, encoder pools or workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# payloads -> one encoder output per payload, in order: the shape of `runner/encoder/runner.EncodeFn`
# (whose outputs are (streams, rows, width) tensors), stated without torch
EncodeFn = Callable[[Sequence[Any]], list[Any]]


@dataclass(frozen=True)
class FaultPlan:
    # a model step whose batch holds this token id raises (after the batch is built, before the forward)
    step_fault_token_id: int | None = None
    # an encoder worker of the first generation exits hard when handed an item with this content key
    encoder_worker_dies_on_key: str | None = None
    # wraps the inline encoder's function (payloads -> outputs): a failing or corrupting encoder
    wrap_encode: Callable[[EncodeFn], EncodeFn] | None = None
    # builds the pool the engine uses instead of starting `encoder_workers` workers (e.g. one whose workers
    # are gone): an object implementing `runner/encoder/pool.EncoderPool`, the runner's protocol
    encoder_pool: Callable[[], Any] | None = None
