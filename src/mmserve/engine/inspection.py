"""A documented test hook: read-only views of an engine's state that no public stat carries.

Role: `EngineInspection` is what `Engine.inspect()` returns, for tests and benchmarks that check how
the engine got an answer, not only the answer: which requests the runner holds and how far each got
(its blocks included), the encoder outputs it holds by content key, how many items' pixels the
engine still keeps per request, the captured graphs and their replays, the paged KV tensors, and the
timing of the last step. Copies taken when `inspect()` is called, except two live handles:
`encoder_outputs`, a read-only view of the runner's store, and `kv_storage`, the engine's KV tensors
themselves (a test may mark a block to see what a step writes; nothing else should touch them).
A test that must change what the engine does plants a `mmserve.faults.FaultPlan` instead.

What it does not know: how the engine keeps any of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mmserve.runner.kv_storage import PagedKVStorage
from mmserve.runner.reports import GraphStats, RunnerRequestView, StepTiming


@dataclass(frozen=True)
class EngineInspection:
    runner_requests: Mapping[str, RunnerRequestView]  # request id -> its state in the runner
    encoder_outputs: Mapping[str, torch.Tensor]  # live, read-only: content key -> (streams, rows, width)
    payloads_held: Mapping[str, int]  # request id -> items whose payload (pixels) the engine still holds
    graphs: GraphStats  # captured encoder and decode graphs (None: that kind is off), replays
    kv_storage: PagedKVStorage  # live: the paged K/V blocks (the scratch block of decode graphs included)
    last_step: StepTiming  # wall time of the runner's last step and of its forward
