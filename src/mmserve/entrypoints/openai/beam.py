"""Beam search on the OpenAI routes: vLLM's `use_beam_search`, `n` the beam width, `length_penalty`,
`early_stopping` (engine/beam_search.py scores it as transformers' `generate(num_beams=n)`).

Role: `beam_params` maps a chat or completion request to `BeamSearchParams`, refusing (400, naming the
field) what beam search does not do — sampling knobs, stop strings and ids, penalties, biases, grammars,
prompt logprobs, a seed (a beam search is deterministic) — rather than ignoring it as vLLM does; the fields
it does honour: n, max_tokens, ignore_eos, temperature (0 or 1), length_penalty, early_stopping,
include_stop_str_in_output, skip_special_tokens (the text), logprobs (the beams' own), return_token_ids,
echo, truncation. `run_beam` runs the search and gives the answer as `start` does: the finished output, and
for a stream one output per choice (vLLM streams a beam search at its end too: each choice's whole text
in one chunk, then its finish).
What it does not know: any endpoint's wire shape, HTTP, how the engine schedules.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from mmserve.engine.beam_driver import beam_search_async
from mmserve.entrypoints.openai.protocol import GenerationRequest, RequestError
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import BeamSearchParams

# request fields beam search does not implement, with the values that ask for nothing
BEAM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0), "seed": (None,), "stop": (None, [], ""),
    "stop_token_ids": (None, []), "min_tokens": (None, 0), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,),
}


def beam_params(body: GenerationRequest, max_model_len: int, num_prompt_tokens: int) -> BeamSearchParams:
    """The request's beam search, or a 400 naming the first field it cannot honour."""
    for name, neutral in BEAM_NEUTRAL.items():
        value = getattr(body, name)
        if value not in neutral:
            raise RequestError(f"{name} is not supported with use_beam_search (got {value!r:.80}): beam search "
                               "keeps the most likely beams", param=name, code="unsupported_parameter")
    if body.requested_prompt_logprobs() is not None:  # completions' echo with logprobs asks for them
        raise RequestError("echo with logprobs is not supported with use_beam_search (it needs the prompt's "
                           "logprobs)", param="echo", code="unsupported_parameter")
    structured, field_name = body.structured()
    if structured is not None:
        raise RequestError(f"{field_name} is not supported with use_beam_search", param=field_name,
                           code="unsupported_parameter")
    # the same context rule, max_tokens default and checks as a sampled request
    sampled = body.sampling_params(max_model_len, num_prompt_tokens)
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        return BeamSearchParams(beam_width=sampled.n, max_tokens=sampled.max_tokens, ignore_eos=sampled.ignore_eos,
                                temperature=temperature, length_penalty=body.length_penalty,
                                early_stopping=body.early_stopping,
                                include_stop_str_in_output=sampled.include_stop_str_in_output)
    except InvalidInputError as exc:
        raise RequestError(str(exc), param="n" if exc.param == "beam_width" else exc.param) from exc


async def _rest(outputs: list[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for output in outputs:
        yield output


def _per_choice(final: RequestOutput) -> list[RequestOutput]:
    """A stream's outputs: choice i's whole text as output i's delta, the last one finished."""
    last = len(final.outputs) - 1
    return [replace(final, delta_index=i, delta_text=c.text, finished=i == last) for i, c in enumerate(final.outputs)]


async def run_beam(client: Any, request_id: str, prompt: ProcessedPrompt, body: GenerationRequest,
                   max_model_len: int, trace_parent: str | None = None,
                   ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """The search run to its end; what `OpenAIServing.start` returns (a failed step's output as it came)."""
    params = beam_params(body, max_model_len, prompt.num_tokens)
    logprobs = body.requested_logprobs()
    try:
        final = await beam_search_async(client, request_id, prompt, params, logprobs, trace_parent)
    except InvalidInputError as exc:
        raise RequestError(str(exc), param="n" if exc.param == "beam_width" else exc.param) from exc
    if not body.stream or final.error is not None:
        return final, _rest([])
    first, *rest = _per_choice(final)
    return first, _rest(rest)
