"""Run scheduled media items through the family's encoder; validate, then commit.

Role: encode one step's items as one batch (`EncodeJob`s: a content key, the family's payload, the
rows expected), check every output's streams, rows, width and dtype before committing any of them
to the store (content key -> (streams, rows, width) tensor), and attribute failures: an output of
the wrong shape fails its key only; an exception from the batch as a whole cannot be pinned to one
item and is reported as a batch error (the scheduler fails only its producers).

What it does not know: requests' progress, budgets, eviction policy (the scheduler sends the keys
to free), what a payload holds (only the family's encoder reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# payloads -> one (streams, rows, width) tensor per payload, in order
EncodeFn = Callable[[Sequence[Any]], list[torch.Tensor]]


@dataclass(frozen=True)
class EncodeJob:
    """One item to encode, keyed by content: the message that carries its payload to the runner."""

    key: str
    payload: Any  # the family's encoder input
    expected_rows: int
    encoder_tokens: int  # pre-merge patches (for accounting)


@dataclass
class EncodeResult:
    committed: list[str] = field(default_factory=list)
    failed_keys: dict[str, str] = field(default_factory=dict)
    batch_error: str | None = None
    num_tokens: int = 0


@dataclass(frozen=True)
class OutputShape:
    """What every committed encoder output must look like (besides its rows)."""

    num_streams: int
    width: int
    dtype: torch.dtype


class EncoderRunner:
    def __init__(self, encode_fn: EncodeFn, shape: OutputShape) -> None:
        self.encode_fn = encode_fn
        self.shape = shape
        self.store: dict[str, torch.Tensor] = {}
        self.num_items_encoded = 0
        self.num_tokens_encoded = 0

    def free(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.store.pop(key, None)

    def forward_items(self, jobs: list[EncodeJob]) -> EncodeResult:
        result = EncodeResult()
        if not jobs:
            return result
        try:
            outputs = self.encode_fn([j.payload for j in jobs])
            if len(outputs) != len(jobs):
                raise RuntimeError(f"encoder returned {len(outputs)} outputs for {len(jobs)} items")
        except Exception as exc:  # cannot be pinned to one item
            result.batch_error = f"encoder failed: {type(exc).__name__}: {exc}"
            return result
        return self.commit(list(zip(jobs, outputs)), result)

    def commit(self, pairs: list[tuple[EncodeJob, torch.Tensor]], result: EncodeResult | None = None) -> EncodeResult:
        """Validate every output, then commit the valid ones to the store (inline and worker outputs alike)."""
        result = result or EncodeResult()
        valid = []
        for job, out in pairs:  # validate every output before committing any
            problem = self._problem(job, out)
            if problem is None:
                valid.append((job, out))
            else:
                result.failed_keys[job.key] = problem
        for job, out in valid:
            if out.untyped_storage().nbytes() != out.numel() * out.element_size():
                out = out.clone()  # a view of the batch's output would pin the whole batch while cached
            self.store[job.key] = out
            result.committed.append(job.key)
            result.num_tokens += job.encoder_tokens
        self.num_items_encoded += len(valid)
        self.num_tokens_encoded += result.num_tokens
        return result

    def _problem(self, job: EncodeJob, out: torch.Tensor) -> str | None:
        s = self.shape
        expected = (s.num_streams, job.expected_rows, s.width)
        if tuple(out.shape) != expected:
            return (f"encoder output for item {job.key[:12]} has shape {tuple(out.shape)}; expected "
                    f"{expected} (streams, rows, width)")
        if out.dtype != s.dtype:
            return f"encoder output for item {job.key[:12]} has dtype {out.dtype}; expected {s.dtype}"
        return None
