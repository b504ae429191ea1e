"""The typed boundary between the API server and a replica: what crosses it, and nothing else.

Role: the messages a replica process takes (add, abort, query, stop) and sends (ready, start failed,
outputs, a request refused or failed, answers, periodic stats). A replica runs today's engine
unchanged behind them; no engine internals cross — a request goes as its `ProcessedPrompt` and
`SamplingParams`, it comes back as `RequestOutput`s.
What it does not know: processes, queues, routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

STATS_INTERVAL_S = 0.5  # how often an idle or busy replica sends its engine's counters

# ---- to a replica ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    arrival_time: float
    trace_parent: str | None = None  # W3C traceparent of the server's span of the request (tracing on)
    sent_s: float = 0.0  # time.time() when the server sent it: the start of the hand-off span
    hand_off: bool = False  # a prefill replica's: park after the first token, for a decode replica


@dataclass(frozen=True)
class ReceiveKV:
    """A decode replica's request admitted earlier (the `admit_transferred` query): its KV is at
    `transfer` (cluster/kv_connector.py); take it and decode, sending outputs as for an `AddRequest`."""

    request_id: str
    transfer: Any


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Query:
    """Ask for `what` ("stats", "check_integrity"; for P/D "admit_transferred" and "send_kv", with their
    `args`); answered by an `Answer` with the same id."""

    query_id: int
    what: str
    args: tuple = ()


@dataclass(frozen=True)
class Stop:
    pass


# ---- from a replica ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pid: int
    max_model_len: int
    block_size: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class StartFailed:
    error: str


@dataclass(frozen=True)
class Outputs:
    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True)
class RequestRefused:
    """The engine refused the request's input (`InvalidInputError`): the request's own fault."""

    request_id: str
    message: str
    param: str | None


@dataclass(frozen=True)
class RequestLost:
    """The replica's engine died while holding the request (the server may send it elsewhere)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class RequestFailed:
    """The replica could not go on with the request (its KV did not arrive): not the replica's death,
    not the request's fault (the server may start it over)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Answer:
    query_id: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class Stats:
    stats: dict[str, Any]
    evicted_media_keys: tuple[str, ...] = ()
    evicted_block_hashes: tuple[bytes, ...] = ()
