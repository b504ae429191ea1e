"""The asyncio face of the engine: many concurrent callers, one engine thread.

Role: `AsyncEngine` owns an `Engine` (which is not thread-safe) from one background thread that
applies queued commands (add, abort) between steps and runs `Engine.step()` whenever there is
work. Callers on the event loop `await` input processing (run in the loop's default executor, so
bad input fails fast with `InvalidInputError` before anything is queued) and iterate
`generate(...)`, which yields each incremental `RequestOutput`. Outputs are delivered to
per-request `asyncio.Queue`s through `loop.call_soon_threadsafe`. A caller that stops iterating
(a client disconnect cancels it) aborts its request, which frees its KV blocks and encoder-cache
references on the engine thread.

What it does not know: HTTP, OpenAI's protocol, media fetching; it sees `ProcessedPrompt`s only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmserve.engine.client import EncodedObserver, EngineDeadError, OutputObserver, StepObserver
from mmserve.engine.frontend import Frontend
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmserve.engine.llm_engine import Engine

logger = logging.getLogger("mmserve.async_engine")
IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks on the command queue before rechecking


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    arrival_time: float
    trace_parent: str | None = None
    hand_off: bool = False


@dataclass(frozen=True)
class _Adopt:
    """Run `fn(engine)`, which makes `request_id` a live request (a decode replica's `receive_kv`)."""

    request_id: str
    fn: Callable[[Engine], None]


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    """Run `fn(engine)` on the engine thread and resolve `future` with its result."""

    fn: Callable[[Engine], Any]
    future: asyncio.Future


@dataclass
class _Stream:
    """Where one request's outputs go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngine:
    """One engine thread; any number of asyncio callers (an `EngineClient`). Start it with `start()` on a
    running loop. The `Engine` is private to its thread: callers reach it only through `call(fn)` and
    `adopt(...)`, which run `fn(engine)` there between steps."""

    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput], None] | None = None,
                 on_encoded: Callable[[int, float], None] | None = None) -> None:
        self._engine = engine
        self._on_output = on_output  # called on the engine thread for every finished output (metrics)
        self._on_encoded = on_encoded  # (worker, latency_s) of every item an encoder worker returned
        self._on_step: StepObserver | None = None  # each step's tokens (prompt tokens admitted + generated)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams between the loop and the engine thread
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._stats: dict[str, int | float | str] = engine.get_stats()

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mmserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._commands.put(None)  # wake the thread if idle
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._engine.shutdown()  # its encoder workers, if any

    def abort_all(self, error: BaseException) -> int:
        """Fail every request in flight with `error` and abort them in the engine (thread-safe; the
        server's shutdown timeout). Returns how many were cut off."""
        with self._lock:
            request_ids = tuple(self._streams)
        self._fail_all(error)
        self._commands.put(_Abort(request_ids))
        return len(request_ids)

    @property
    def frontend(self) -> Frontend:
        """The engine's processor, spec, stop ids, grammar compiler and max_model_len (EngineClient)."""
        return self._engine.frontend

    def observe(self, on_output: OutputObserver | None = None, on_encoded: EncodedObserver | None = None,
                on_step: StepObserver | None = None) -> None:
        """Install the server's metrics observers (before `start`; EngineClient)."""
        self._on_output, self._on_encoded, self._on_step = on_output, on_encoded, on_step

    async def check_integrity(self) -> None:
        """The engine's `check_integrity()`, run between steps on its thread."""
        await self.call(lambda engine: engine.check_integrity())

    @property
    def tracing(self) -> Any:
        """The engine's `Tracing` (None: no tracing)."""
        return self._engine.tracing

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ---- the caller's side ------------------------------------------------------------------------
    async def process_chat(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                           **template_kwargs: Any) -> ProcessedPrompt:
        """Render and process a chat off the event loop; raises InvalidInputError on bad input."""
        return await self._engine.frontend.process_chat_off_loop(messages, mm_processor_kwargs, **template_kwargs)

    async def process(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None,
                      item_params: dict[str, list[str]] | None = None) -> ProcessedPrompt:
        return await self._engine.frontend.process_off_loop(raw_prompt, mm_processor_kwargs, item_params)

    async def generate(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                       arrival_time: float | None = None, restartable: bool = False,
                       trace_parent: str | None = None, hand_off: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes. Closing or cancelling the
        iterator early aborts the request. `arrival_time` (time.time()) defaults to now; a server
        passes when the HTTP request arrived, so time-to-first-token includes input processing.
        `restartable` (the caller shows its client only the finished output) matters to replicas,
        which may start such a request over elsewhere; one engine never restarts a request.
        `trace_parent`: the W3C traceparent of the caller's span (the engine's spans go under it).
        `hand_off`: a prefill replica's (Engine.add_request)."""
        outputs = self._follow(request_id, _Add(request_id, prompt, params, arrival_time or time.time(), trace_parent,
                                                hand_off))
        del prompt  # the engine owns it now: this generator must not keep the pixels alive to the end
        async for output in outputs:
            yield output

    async def adopt(self, request_id: str, fn: Callable[[Engine], None]) -> AsyncIterator[RequestOutput]:
        """Run `fn(engine)` on the engine thread, which makes `request_id` live (a decode replica's
        `receive_kv`), and yield its outputs as `generate` does; `fn`'s exception is raised here."""
        async for output in self._follow(request_id, _Adopt(request_id, fn)):
            yield output

    async def _follow(self, request_id: str, command: _Add | _Adopt) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._commands.put(command)
        del command
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort((request_id,)))
            with self._lock:
                self._streams.pop(request_id, None)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (for checks that need a still engine)."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def stats(self) -> dict[str, int | float | str]:
        """The engine's counters as of the end of its latest step or command (a snapshot)."""
        return dict(self._stats)

    async def current_stats(self) -> dict[str, int | float | str]:
        """The same snapshot (replicas answer this one by asking each replica)."""
        return self.stats()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._apply_commands(block=not self._engine.has_unfinished_requests())
                stepped = self._engine.has_unfinished_requests()
                if stepped:
                    self._deliver(self._engine.step())
                    if self._on_encoded is not None:
                        for outcome in self._engine.take_encoder_outcomes():
                            self._on_encoded(outcome.worker, outcome.latency_s)
                stats, before = self._engine.get_stats(), self._stats
                if stepped and self._on_step is not None:  # the step's tokens, from the counters it moved
                    self._on_step(_step_tokens(before, stats))
                self._stats = stats
        except BaseException as exc:  # a step that raises leaves the engine unusable: fail everyone
            logger.exception("the engine thread died")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc}"))

    def _apply_commands(self, block: bool) -> None:
        """Apply every queued command; when idle, first wait a little for one to arrive."""
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                if command is not None:  # None only wakes the thread up (shutdown)
                    self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, command: _Add | _Adopt | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            try:
                self._engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time,
                                        command.trace_parent, command.hand_off)
            except InvalidInputError as exc:
                self._send(command.request_id, exc)
        elif isinstance(command, _Adopt):
            try:
                command.fn(self._engine)
            except Exception as exc:  # noqa: BLE001 - the KV did not arrive: this request fails, the engine runs on
                logger.warning("request %s: %s", command.request_id, exc)
                self._engine.abort_request([command.request_id])
                self._send(command.request_id, exc)
        elif isinstance(command, _Abort):
            self._deliver(self._engine.abort_request(list(command.request_ids)))
        else:
            try:
                result: Any = command.fn(self._engine)
                setter = command.future.set_result
            except Exception as exc:  # handed back to the caller, who re-raises it
                result, setter = exc, command.future.set_exception
            command.future.get_loop().call_soon_threadsafe(_resolve, command.future, setter, result)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished and self._on_output is not None:
                self._on_output(output)
            self._send(output.request_id, output)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:  # None: the caller went away and already asked for an abort
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._send(request_id, error)


def _step_tokens(before: dict[str, int | float | str], after: dict[str, int | float | str]) -> int:
    """Prompt tokens of the requests a step admitted plus the tokens it generated (vLLM's tokens per step)."""
    return sum(int(after[k]) - int(before[k]) for k in ("prompt_tokens", "generation_tokens"))  # type: ignore[arg-type]


def _resolve(future: asyncio.Future, setter: Callable[[Any], None], value: Any) -> None:
    if not future.done():  # the caller may have been cancelled meanwhile
        setter(value)
