"""The only code that turns step results into `RequestOutput`s.

Role: owns each live request's output state (engine/request_state.py: detokenizer, kept tokens, logprob
entries, prompt logprobs, cumulative logprob, stop reason, metrics, timeline). `process` takes the
scheduler's `EngineCoreOutput`s, each with any number of new tokens (one per step today; k with
speculative decoding), and walks them token by token: logprobs are kept per token, the grammar checks
the step's tokens, and the detokenizer finds stop strings; a stop string ending at token i of k drops
the tokens after it. Stop ids, `min_tokens`/`max_tokens` and the context length are the scheduler's
(core/scheduler.py checks them token by token and drops the surplus before this sees them). `process`
returns the outputs and the requests it finished that the scheduler still runs (a stop string, a
refused token), which the engine finishes there so their KV and encoder references are freed.
`add`, `finish` (rejected at admission, handed off) and `abort` complete the lifecycle; a finished
request's state is released here and the engine is told through `on_finished`.
What it does not know: scheduling, KV blocks, tensors, the runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from mmserve.core.request import Request, RequestStatus
from mmserve.core.step import EngineCoreOutput, TokenLogprobs
from mmserve.engine.choices import ChoiceGroups
from mmserve.engine.detokenizer import Decoder, IncrementalDetokenizer
from mmserve.engine.request_spans import record_finished
from mmserve.engine.request_state import RequestState
from mmserve.engine.timeline import RequestTimeline
from mmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

logger = logging.getLogger("mmserve.engine")
GRAMMAR_REFUSED = "internal error: the grammar refused a sampled token"


class Grammars(Protocol):
    """What the output side needs of the structured outputs (engine/structured_outputs.py)."""

    def accept(self, request_id: str, token_ids: list[int]) -> bool: ...

    def release(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class Cut:
    """A request this step's output processing cut short."""

    #: finish it in the scheduler with this (None: the scheduler finished it itself, or it runs on)
    status: RequestStatus | None
    #: the step's tokens after the one that ended it, which the scheduler appended but nobody keeps
    num_dropped_tokens: int


class OutputProcessor:
    def __init__(self, tokenizer: Decoder, grammars: Grammars, choices: ChoiceGroups, tracing: Any = None,
                 on_finished: Callable[[str], None] = lambda request_id: None,
                 clock: Callable[[], float] = time.time) -> None:
        """`choices`: folds the outputs of an n > 1 request's choices into its own; `tracing`: a
        `mmserve.tracing.Tracing` a traced request's spans go to; `on_finished(request id)`: called once per
        finished sequence (the engine drops its runner state and payloads)."""
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._choices = choices
        self._tracing = tracing
        self._on_finished = on_finished
        self._clock = clock
        self._states: dict[str, RequestState] = {}
        # one token's text, as logprob entries name it: decoded once per id (at most the vocabulary)
        self._token_texts: dict[int, str] = {}

    # ---- lifecycle ------------------------------------------------------------------------------
    def add(self, request: Request, prompt: str | None, trace_parent: str | None = None,
            first: CompletionOutput | None = None) -> None:
        """Track a request's outputs (`prompt`: its text, if it came as text). `trace_parent`: the W3C
        traceparent its spans go under, with tracing on. `first`: its first output, computed on a prefill
        replica (its token and logprobs are kept; its text was sent there)."""
        if request.request_id in self._states:
            raise ValueError(f"request id {request.request_id!r} is already tracked")
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                             params.stop, params.include_stop_str_in_output)
        state = RequestState(request, prompt, detokenizer, RequestMetrics(request.arrival_time,
                                                                          max_tokens=params.max_tokens),
                             logprobs=None if params.logprobs is None else [],
                             prompt_logprobs=None if params.prompt_logprobs is None else [None])
        if self._tracing is not None:
            state.timeline = RequestTimeline(trace_parent, self._clock())
        if first is not None:
            state.token_ids.extend(first.token_ids)
            detokenizer.update(list(first.token_ids))
            detokenizer.take_delta(False)  # the prefill replica sent that text
            if state.logprobs is not None and first.logprobs:
                state.logprobs.extend(first.logprobs)
                state.cumulative_logprob = first.cumulative_logprob or 0.0
        self._states[request.request_id] = state

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def live_ids(self) -> set[str]:
        return set(self._states)

    def traced(self) -> dict[str, RequestState]:
        """The live requests that are traced, by id."""
        return {rid: s for rid, s in self._states.items() if s.timeline is not None}

    def scheduled(self, request_ids: Iterable[str], now_s: float) -> None:
        """Requests a step computes: the first time counts as their first scheduling."""
        for rid in request_ids:
            metrics = self._states[rid].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now_s

    def mark_internal_error(self, request_ids: Iterable[str]) -> None:
        """A fault in a model step touched these requests: their errors are the server's."""
        for rid in request_ids:
            if rid in self._states:
                self._states[rid].internal_error = True

    def finish(self, request_id: str, finish_reason: str, error: str | None = None) -> RequestOutput:
        """Finish a tracked request outside a step (rejected at admission, handed off): its last output."""
        return self._output(self._states[request_id], finish_reason, error)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """The last outputs of the live requests among `request_ids` (sequence ids; others are skipped)."""
        return [self._output(self._states[rid], "abort") for rid in request_ids if rid in self._states]

    # ---- steps ----------------------------------------------------------------------------------
    def process(self, core_outputs: Iterable[EngineCoreOutput]) -> tuple[list[RequestOutput], dict[str, Cut]]:
        """The outputs of a step's results, and the requests this cut short: finished here while the
        scheduler still runs them, or ended before the step's last token (the scheduler's books count
        tokens the request did not keep)."""
        outputs: list[RequestOutput] = []
        cuts: dict[str, Cut] = {}
        now_s = self._clock()
        for core in core_outputs:
            state = self._states[core.request_id]
            if core.new_token_ids:
                _token_step(state, now_s)
            if core.pooled is not None:
                state.pooled = list(core.pooled)
            finish, error, cut = self._take_tokens(state, core)
            if cut.status is not None or cut.num_dropped_tokens:
                cuts[core.request_id] = cut
            output = self._output(state, finish, error)
            output.kv_parked = core.parked and finish is None
            outputs.append(output)
        return outputs, cuts

    def _take_tokens(self, state: RequestState, core: EngineCoreOutput) -> tuple[str | None, str | None, Cut]:
        """Keep a step's tokens one by one: (finish reason, error, how this cut the request short). A token
        the grammar refuses (kept, as the step computed it) or a stop string ending at a token drops the
        tokens after it; at the step's last token a finish the scheduler already decided (a stop id,
        `max_tokens`) stands."""
        rid, tokens = core.request_id, core.new_token_ids
        finish, error = core.finish_reason, core.error
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            refused = not self._grammars.accept(rid, [token])
            state.token_ids.append(token)
            if state.logprobs is not None and i < len(core.new_logprobs):
                state.logprobs.append(self._logprob_entry(token, core.new_logprobs[i]))
                state.cumulative_logprob += core.new_logprobs[i].logprob
            # a stop id ending the request is in the tokens, not the text, unless asked for (vLLM's rule; its
            # text shows only with skip_special_tokens=False, or for a stop id that is an ordinary token)
            ends_on_stop_id = last and core.stop_token_id is not None and finish is not None
            stop_string = None
            if not ends_on_stop_id or state.request.sampling_params.include_stop_str_in_output:
                stop_string = state.detokenizer.update([token])
            if refused:  # the mask allowed only tokens the grammar accepts: a refusal is the engine's fault
                logger.error("%s: the grammar refused a sampled token", rid)
                status = RequestStatus.FINISHED_ABORTED if finish is None else None
                state.internal_error = True
                return "error", GRAMMAR_REFUSED, Cut(status, len(tokens) - i - 1)
            if stop_string is not None and error is None and (finish is None or not last):
                state.stop_reason = stop_string
                status = RequestStatus.FINISHED_STOPPED if finish is None else None
                return "stop", error, Cut(status, len(tokens) - i - 1)
        if core.stop_token_id is not None:
            state.stop_reason = core.stop_token_id
        return finish, error, Cut(None, 0)

    def record_prompt_logprobs(self, computed: dict[str, tuple[int, tuple[TokenLogprobs, ...]]]) -> None:
        """Append each request's new prompt logprobs (a prompt recomputed after a preemption has them)."""
        for rid, (start, entries) in computed.items():
            state = self._states.get(rid)
            if state is None or state.prompt_logprobs is None:
                continue
            prompt = state.request.prompt_token_ids
            for position, logprobs in enumerate(entries, start=start + 1):
                if position == len(state.prompt_logprobs):
                    state.prompt_logprobs.append(self._logprob_entry(prompt[position], logprobs))

    # ---- outputs --------------------------------------------------------------------------------
    def _logprob_entry(self, token_id: int, logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled token first, then the top ones (the sampled one among them keeps its entry)."""
        entry = {token_id: Logprob(logprobs.logprob, logprobs.rank, self._token_text(token_id))}
        for rank, (top_id, value) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(value, rank, self._token_text(top_id))
        return entry

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _output(self, state: RequestState, finish: str | None, error: str | None = None) -> RequestOutput:
        request = state.request
        finished = finish is not None
        if finished:
            self._release(state, finish, error)
        delta = state.detokenizer.take_delta(finished)
        logprobs = state.logprobs
        completion = CompletionOutput(0, state.detokenizer.output_text, list(state.token_ids), finish,
                                      state.stop_reason if finish == "stop" else None,
                                      None if logprobs is None else list(logprobs),
                                      None if logprobs is None else state.cumulative_logprob)
        return self._choices.fold(RequestOutput(
            request.request_id, state.prompt, request.prompt_token_ids, [completion], finished,
            max(request.num_cached_tokens, 0), state.metrics, error, delta, internal_error=state.internal_error,
            num_mm_items=request.num_mm_items, num_encoder_cached_mm_items=request.num_encoder_cached_items,
            num_prefix_cached_mm_items=request.num_prefix_cached_items,
            prompt_logprobs=None if state.prompt_logprobs is None else list(state.prompt_logprobs),
            pooled=state.pooled))

    def _release(self, state: RequestState, finish: str, error: str | None) -> None:
        """A request finished: close its metrics and spans, drop its state and its grammar matcher."""
        request = state.request
        state.metrics.finish_time = self._clock()
        state.metrics.num_preemptions = request.num_preemptions
        state.metrics.num_draft_tokens = request.num_draft_tokens
        state.metrics.num_accepted_tokens = request.num_accepted_draft_tokens
        state.metrics.inter_token_latencies_s = state.inter_token_latencies_s
        if state.timeline is not None and self._tracing is not None:
            record_finished(self._tracing, state, finish, error)
        self._states.pop(request.request_id, None)
        self._grammars.release(request.request_id)
        self._on_finished(request.request_id)


def _token_step(state: RequestState, now_s: float) -> None:
    """A step gave the request tokens: its first token's time, or one more inter-token latency."""
    metrics = state.metrics
    if metrics.first_token_time is None:
        metrics.first_token_time = now_s
    elif metrics.last_token_time is not None:
        state.inter_token_latencies_s.append(now_s - metrics.last_token_time)
    metrics.last_token_time = now_s
