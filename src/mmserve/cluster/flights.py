"""A request the API server holds while a replica computes it: enough to send it again.

Role: `Flight` is the server's record of one request sent to replicas (where it is, which generation
of that replica holds it, whether the router counts it, whether its client has seen tokens, its
outputs' queue); `ReplicaLost` is put in that queue when the replica holding it died. The replica
set (cluster/replicas.py) and the P/D hand-off (cluster/pd_flow.py) both move flights.
What it does not know: processes, messages, routing decisions.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mmserve.cluster.router import RouteKeys
from mmserve.inputs.items import ProcessedPrompt
from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReplicaLost:
    """Put in a request's queue when its replica died holding it."""

    message: str


@dataclass
class Flight:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    arrival_time: float
    keys: RouteKeys
    restartable: bool
    trace_parent: str | None = None
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    replica: int | None = None
    generation: int = -1
    counted: bool = False  # the router counts it in flight on `replica`
    sent_tokens: bool = False
    transfer: Any = None  # P/D: its KV's transfer handle, once the prefill replica has sent it
