"""Beam search driven through an engine: each step, one one-token request per live beam.

Role: `beam_search_async` runs one prompt's `BeamSearch` over an `EngineClient` (vLLM's
`EngineClient.beam_search` does the same): every step submits each live beam's prompt (`beam_prompt`: the
prompt, its media included, then the beam's tokens) for one token with its top logprobs, all beams at once,
and advances the search with their entries; the KV prefix cache holds what the beams share, so a step
costs about one decode per beam. `run_offline` does the same for several prompts at once over an `Engine`
(the offline `LLM.beam_search`). `as_request_output` and `as_beam_output` turn a finished search into the
shapes the callers answer with.
What it does not know: HTTP, how the engine schedules, transformers (beam_search.py keeps its rules).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from mmserve.engine.beam_search import BeamSearch, Hypothesis, beam_prompt, step_params
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from mmserve.sampling_params import BeamSearchParams

Decode = Callable[[list[int]], str]


class BeamStepFailed(RuntimeError):
    """A beam's step request failed (its output carried an error)."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__(output.error or "a beam search step failed")
        self.output = output


def _entry(output: RequestOutput) -> dict[int, Logprob]:
    if output.error is not None or not output.outputs[0].logprobs:
        raise BeamStepFailed(output)
    return output.outputs[0].logprobs[0]


def _text(search: BeamSearch, hypothesis: Hypothesis, decode: Decode) -> str:
    """The hypothesis' text; an ending EOS is left out unless include_stop_str_in_output."""
    ids = list(hypothesis.token_ids)
    if ids and search.finish_reason(hypothesis)[0] == "stop" and not search.params.include_stop_str_in_output:
        ids = ids[:-1]
    return decode(ids)


def as_request_output(search: BeamSearch, request_id: str, prompt: ProcessedPrompt, first: RequestOutput,
                      decode: Decode, num_logprobs: int | None) -> RequestOutput:
    """The W best hypotheses as one request's choices (index = rank), with the first step's prompt figures."""
    outputs = []
    for i, hypothesis in enumerate(search.best()):
        reason, stop = search.finish_reason(hypothesis)
        outputs.append(CompletionOutput(i, _text(search, hypothesis, decode), list(hypothesis.token_ids), reason,
                                        stop, list(hypothesis.entries) if num_logprobs is not None else None,
                                        float(sum(float(e[t].logprob) for t, e in zip(hypothesis.token_ids,
                                                                                     hypothesis.entries)))))
    return RequestOutput(request_id, prompt.prompt, list(prompt.prompt_token_ids), outputs, True,
                         num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
                         num_mm_items=first.num_mm_items,
                         num_encoder_cached_mm_items=first.num_encoder_cached_mm_items,
                         num_prefix_cached_mm_items=first.num_prefix_cached_mm_items)


def as_beam_output(search: BeamSearch, prompt: ProcessedPrompt, decode: Decode) -> BeamSearchOutput:
    sequences = []
    for hypothesis in search.best():
        reason, stop = search.finish_reason(hypothesis)
        sequences.append(BeamSearchSequence(
            list(prompt.prompt_token_ids) + list(hypothesis.token_ids), list(hypothesis.entries),
            float(sum(float(e[t].logprob) for t, e in zip(hypothesis.token_ids, hypothesis.entries))),
            float(hypothesis.score), _text(search, hypothesis, decode), reason, stop))
    return BeamSearchOutput(sequences)


async def _one_step(client: Any, request_id: str, prompt: ProcessedPrompt, params: Any,
                    trace_parent: str | None) -> RequestOutput:
    outputs = client.generate(request_id, prompt, params, trace_parent=trace_parent)
    last = None
    try:
        async for output in outputs:
            last = output
    finally:  # cancelled (the caller went away): closing aborts the step's request
        with contextlib.suppress(Exception):
            await outputs.aclose()
    assert last is not None
    return last


async def beam_search_async(client: Any, request_id: str, prompt: ProcessedPrompt, params: BeamSearchParams,
                            num_logprobs: int | None = None, trace_parent: str | None = None) -> RequestOutput:
    """One prompt's beam search over an `EngineClient`: the finished request, its choices the W best
    hypotheses; a failed step's output (carrying its error) if a step fails. `num_logprobs`: the top
    logprobs the caller shows per token (None: none)."""
    search = BeamSearch(params, client.frontend.eos_token_ids)
    sampling = step_params(search, num_logprobs or 0)
    first = None
    while not search.done:
        step = search.num_generated
        results = await asyncio.gather(*(
            _one_step(client, f"{request_id}-beam{step}.{b}", beam_prompt(prompt, beam.token_ids), sampling,
                      trace_parent) for b, beam in enumerate(search.beams)))
        failed = next((r for r in results if r.error is not None), None)
        if failed is not None:
            return failed
        first = first or results[0]
        search.advance([_entry(r) for r in results])
    tokenizer = client.frontend.processor.tokenizer
    return as_request_output(search, request_id, prompt, first, tokenizer.decode, num_logprobs)


def run_offline(engine: Any, prompts: Sequence[ProcessedPrompt], params: BeamSearchParams, decode: Decode,
                request_prefix: str) -> list[BeamSearchOutput]:
    """Every prompt's beam search at once over an `Engine` (each step's beams of all prompts in one batch)."""
    searches = [BeamSearch(params, engine.eos_token_ids) for _ in prompts]
    sampling = step_params(searches[0], 0) if searches else None
    while not all(s.done for s in searches):
        ids: dict[str, tuple[int, int]] = {}
        try:
            for p, search in enumerate(searches):
                if search.done:
                    continue
                for b, beam in enumerate(search.beams):
                    rid = f"{request_prefix}-{p}-beam{search.num_generated}.{b}"
                    engine.add_request(rid, beam_prompt(prompts[p], beam.token_ids), sampling)
                    ids[rid] = (p, b)
            entries: dict[tuple[int, int], dict[int, Logprob]] = {}
            while len(entries) < len(ids):
                for output in engine.step():
                    if output.finished and output.request_id in ids:
                        entries[ids[output.request_id]] = _entry(output)
        except BaseException:
            engine.abort_request(list(ids))
            raise
        for p, search in enumerate(searches):
            if not search.done:
                search.advance([entries[(p, b)] for b in range(len(search.beams))])
    return [as_beam_output(s, prompt, decode) for s, prompt in zip(searches, prompts)]
