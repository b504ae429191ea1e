"""EngineClient: the one seam between a server (or any asyncio caller) and "one engine or many".

Role: the protocol the OpenAI server, `build_app`, `serve` and the CLI's start-up summary talk to.
`AsyncEngine` (one engine on its own thread) and the cluster's `ReplicaSet` (many engine processes or
Ray actors behind a router) both implement it, so the server never asks which one it holds, and never
reaches through it to an `Engine`: what it needs to know before weights (the processor, the spec, the
structured-output compiler, `max_model_len`) it reads from `frontend`.
What it does not know: how requests are scheduled, where they run, or HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mmserve.engine.frontend import Frontend
    from mmserve.inputs.items import ProcessedPrompt
    from mmserve.outputs import RequestOutput
    from mmserve.sampling_params import SamplingParams

class EngineDeadError(RuntimeError):
    """The engine stopped under a request (a step raised, or the engine or its replicas were shut down)."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down and cut this request off at its shutdown timeout."""


#: called on an engine's thread (or a replica reader's) for every finished output: the server's metrics
OutputObserver = Callable[["RequestOutput"], None]
#: (encoder worker, latency_s) of every item an encoder worker returned: the server's metrics
EncodedObserver = Callable[[int, float], None]
#: the tokens of every engine step (prompt tokens admitted + tokens generated): the server's metrics
StepObserver = Callable[[int], None]


@runtime_checkable
class EngineClient(Protocol):
    """What a server needs of the engine(s) behind it. All coroutine methods run on the server's loop."""

    #: the processor, spec, stop ids, grammar compiler and `max_model_len` (no weights)
    frontend: Frontend
    #: the server's `Tracing` (None: tracing is off)
    tracing: Any

    def observe(self, on_output: OutputObserver | None = None, on_encoded: EncodedObserver | None = None,
                on_step: StepObserver | None = None) -> None:
        """Install the observers the server's metrics need (before `start`)."""
        ...

    def start(self) -> None:
        """Start serving on the running event loop (the engine thread, or the replicas' readers)."""
        ...

    def shutdown(self) -> None:
        """Stop everything this client started (threads, processes, actors, encoder workers)."""
        ...

    @property
    def is_running(self) -> bool:
        """True while at least one engine can take requests."""
        ...

    def abort_all(self, error: BaseException) -> int:
        """Fail every request in flight with `error` and abort it (thread-safe); how many were cut off."""
        ...

    async def process(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None,
                      item_params: dict[str, list[str]] | None = None) -> ProcessedPrompt:
        """Process a vLLM-style prompt off the event loop; raises InvalidInputError on bad input."""
        ...

    async def process_chat(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                           **template_kwargs: Any) -> ProcessedPrompt:
        """Render and process a chat off the event loop; raises InvalidInputError on bad input."""
        ...

    def generate(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                 arrival_time: float | None = None, restartable: bool = False,
                 trace_parent: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes; closing the iterator early aborts it.
        `restartable`: the caller shows its client only the finished output (a replica set may start it
        over elsewhere). `trace_parent`: the W3C traceparent of the caller's span."""
        ...

    def stats(self) -> dict[str, Any]:
        """The latest counters (a snapshot; never blocks)."""
        ...

    async def current_stats(self) -> dict[str, Any]:
        """The counters as of now (a replica set asks each replica)."""
        ...

    async def check_integrity(self) -> None:
        """Assert that nothing leaked in any engine (AssertionError naming what)."""
        ...
