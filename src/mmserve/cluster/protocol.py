"""The typed boundary between the API server and a replica: what crosses it, and nothing else.

Role: the messages a replica process takes (add, receive KV, abort, query, stop) and sends (ready,
start failed, outputs, a request refused or failed, answers, periodic stats), one frozen dataclass
per intent: a replica handles each by its type (a dispatch table), never by a verb in a string. A
`Query` carries one of the questions (`AskStats`, `AskIntegrity`, and for P/D `AdmitTransferred`,
`SendKV`) and is answered by an `Answer` with its id. A replica runs today's engine unchanged behind
them; no engine internals cross — a request goes as its `ProcessedPrompt` and `SamplingParams`, it
comes back as `RequestOutput`s.
What it does not know: processes, queues, routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import CompletionOutput, RequestOutput
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
    """A decode replica's request admitted earlier (the `AdmitTransferred` question): its KV is at
    `transfer` (cluster/kv_connector.py); take it and decode, sending outputs as for an `AddRequest`."""

    request_id: str
    transfer: Any


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class AskStats:
    """The engine's counters now, read on its thread between steps (a dict; the last sent ones when the
    engine no longer runs)."""


@dataclass(frozen=True)
class AskIntegrity:
    """Run the engine's `check_integrity()` (an error when it fails, or when the engine no longer runs)."""


@dataclass(frozen=True)
class AdmitTransferred:
    """P/D, to a decode replica: take this request computed elsewhere (`first`: its first output there);
    answered by the indices of its prompt blocks to send (those this replica lacks), or None while there
    is no room (ask again later)."""

    request_id: str
    prompt: ProcessedPrompt  # without media payloads: nothing is encoded on the decode side
    params: SamplingParams
    first: CompletionOutput
    arrival_time: float
    trace_parent: str | None = None


@dataclass(frozen=True)
class SendKV:
    """P/D, to a prefill replica: put the parked request's blocks at `block_indices` into the connector;
    answered by the transfer's handle (cluster/kv_connector.py)."""

    request_id: str
    block_indices: tuple[int, ...]


Question = AskStats | AskIntegrity | AdmitTransferred | SendKV


@dataclass(frozen=True)
class Query:
    """One question to a replica, answered by an `Answer` with the same id."""

    query_id: int
    question: Question


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
