"""Run scheduled media items through the vision tower; validate, then commit.

Role: encode one step's items as one batch, check every output's rows, width and dtype before
committing any of them to the store (content key -> embedding rows), and attribute failures:
an output of the wrong shape fails its key only; an exception from the batch as a whole cannot be
pinned to one item and is reported as a batch error (the scheduler fails only its producers).

What it does not know: requests' progress, budgets, eviction policy (the scheduler sends the keys
to free).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# (pixel_values, grids) -> one (rows, hidden) tensor per item, in order
EncodeFn = Callable[[torch.Tensor, Sequence[tuple[int, int, int]]], list[torch.Tensor]]


@dataclass(frozen=True)
class EncodeJob:
    key: str
    pixel_values: np.ndarray  # (encoder_tokens, C*T*P*P)
    grid_thw: tuple[int, int, int]
    expected_rows: int


@dataclass
class EncodeResult:
    committed: list[str] = field(default_factory=list)
    failed_keys: dict[str, str] = field(default_factory=dict)
    batch_error: str | None = None
    num_tokens: int = 0


class EncoderRunner:
    def __init__(self, encode_fn: EncodeFn, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.encode_fn = encode_fn
        self.width = width
        self.dtype = dtype
        self.device = device
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
            pixels = torch.from_numpy(np.concatenate([j.pixel_values for j in jobs]))
            outputs = self.encode_fn(pixels.to(self.device, non_blocking=True), [j.grid_thw for j in jobs])
            if len(outputs) != len(jobs):
                raise RuntimeError(f"encoder returned {len(outputs)} outputs for {len(jobs)} items")
        except Exception as exc:  # cannot be pinned to one item
            result.batch_error = f"encoder failed: {type(exc).__name__}: {exc}"
            return result
        valid = []
        for job, out in zip(jobs, outputs):  # validate every output before committing any
            problem = self._problem(job, out)
            if problem is None:
                valid.append((job, out))
            else:
                result.failed_keys[job.key] = problem
        for job, out in valid:
            self.store[job.key] = out
            result.committed.append(job.key)
            result.num_tokens += job.pixel_values.shape[0]
        self.num_items_encoded += len(valid)
        self.num_tokens_encoded += result.num_tokens
        return result

    def _problem(self, job: EncodeJob, out: torch.Tensor) -> str | None:
        if out.dim() != 2 or out.shape[0] != job.expected_rows:
            return (f"encoder output for item {job.key[:12]} has shape {tuple(out.shape)}; "
                    f"expected {job.expected_rows} rows")
        if out.shape[1] != self.width:
            return f"encoder output for item {job.key[:12]} has width {out.shape[1]}; expected {self.width}"
        if out.dtype != self.dtype:
            return f"encoder output for item {job.key[:12]} has dtype {out.dtype}; expected {self.dtype}"
        return None
