"""Text completions: POST /v1/completions, its request and response bodies, and how it is served.

Role: the completion request (one prompt or several, as text or token ids; `media` for the prompt's
placeholders; echo, logprobs in the legacy shape) and its answer, which is also its stream's chunk shape;
`CompletionServing` processes each prompt, submits it through the shared core (serving.py) — several
prompts as one request whose choice j of prompt i is choice i * n + j — and answers with the text, or a
stream of it.
What it does not know: the engine behind the client, routing beyond its own route, authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from mmserve.entrypoints.openai.logprobs import completion_logprobs, echo_logprobs, joined, prompt_logprobs
from mmserve.entrypoints.openai.media import resolve_media
from mmserve.entrypoints.openai.protocol import (
    CompletionLogprobs,
    GenerationRequest,
    PromptLogprobs,
    RequestError,
    Usage,
)
from mmserve.entrypoints.openai.serving import OpenAIServing
from mmserve.entrypoints.openai.streaming import StreamCursor, choice_usage, usage_of
from mmserve.errors import at_param
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput


# ---- the wire format -------------------------------------------------------------------------------
class CompletionRequest(GenerationRequest):
    route_unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),  # chat only
        "add_special_tokens": (None, True)}  # vLLM's: the tokenizer's own (a BOS where it adds one)
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt, or several (one choice each, x n)
    # extension: media for the prompt's placeholders, as chat content parts (image_url / video_url)
    media: list[dict[str, Any]] | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None  # top logprobs per token; 0: the sampled token's only

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens get theirs too."""
        self._check_prompt_logprobs()
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs (vLLM's field)
    token_ids: list[int] | None = None  # with return_token_ids (streamed: the tokens new in this chunk)
    prompt_token_ids: list[int] | None = None  # with return_token_ids (streamed: in the choice's first chunk)


class CompletionResponse(BaseModel):
    """Both the whole response and, with `stream`, each chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- serving ---------------------------------------------------------------------------------------
class _PromptBatch:
    """Several prompts' requests as one: choice j of prompt i is choice i * n + j; the last output holds
    every choice and counts every prompt's tokens."""

    def __init__(self, n: int, num_prompts: int) -> None:
        self.n = n
        self.latest: list[RequestOutput | None] = [None] * num_prompts
        self.failed: RequestOutput | None = None  # the first prompt's output that carried an error

    def reindex(self, i: int, output: RequestOutput) -> RequestOutput:
        self.latest[i] = output
        if output.error is not None and self.failed is None:
            self.failed = output
        if all(o is not None and o.finished for o in self.latest):
            every = [replace(c, index=p * self.n + c.index) for p, o in enumerate(self.latest) for c in o.outputs]
            ids = [t for o in self.latest for t in o.prompt_token_ids]
            failed = self.failed or output
            return replace(output, outputs=every, prompt_token_ids=ids, finished=True,
                           delta_index=i * self.n + output.delta_index, error=failed.error,
                           internal_error=failed.internal_error)
        return replace(output, outputs=[replace(c, index=i * self.n + c.index) for c in output.outputs],
                       finished=False)

    async def merged(self, started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]
                     ) -> AsyncIterator[RequestOutput]:
        """The prompts' first outputs after the first, then every output as it comes; closing it closes
        (and so aborts) every prompt's request."""
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, (first, _) in enumerate(started[1:], start=1):
                yield self.reindex(i, first)
            pending = {asyncio.ensure_future(anext(outputs)): i for i, (first, outputs) in enumerate(started)
                       if not first.finished}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    output = task.result()
                    if not output.finished:
                        pending[asyncio.ensure_future(anext(started[i][1]))] = i
                    yield self.reindex(i, output)
        finally:
            for task in pending:
                task.cancel()
            # a generator is closed only once its cancelled step has ended (else: "already running")
            await asyncio.gather(*pending, return_exceptions=True)
            for _, outputs in started:
                with contextlib.suppress(Exception):
                    await outputs.aclose()


class CompletionServing:
    """POST /v1/completions over the shared core."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _raw_prompts(self, body: CompletionRequest) -> list[dict[str, Any]]:
        """The request's prompts: a string, a list of strings, token ids, or a list of token-id lists."""
        if body.suffix:
            raise RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise RequestError("prompt must not be empty", param="prompt")
        if len(prompts) > 1:
            for name, asked in (("echo", body.echo), ("prompt_logprobs", body.prompt_logprobs is not None),
                                ("media", bool(body.media)), ("return_token_ids", body.return_token_ids)):
                if asked:
                    raise RequestError(f"{name} is not supported with several prompts: send one request per "
                                       "prompt", param=name, code="unsupported_parameter")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]

    async def _start_several(self, request_id: str, raw_prompts: list[dict[str, Any]], body: CompletionRequest,
                             raw: Request, arrival_time: float) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """One engine request per prompt; their outputs as one request's, choice j of prompt i being choice
        i * n + j (as OpenAI numbers them). A prompt refused aborts the ones already started."""
        prompts = []
        for i, raw_prompt in enumerate(raw_prompts):
            with at_param(f"prompt[{i}]"):
                prompts.append(await self._completion_prompt(body, raw_prompt))
        # submitted together, so their prefills share steps
        results = await asyncio.gather(*(self.serving.start(f"{request_id}-{i}", prompt, body, raw, arrival_time)
                                         for i, prompt in enumerate(prompts)), return_exceptions=True)
        started = [r for r in results if not isinstance(r, BaseException)]
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is not None:
            for _, outputs in started:
                await outputs.aclose()
            raise refused
        batch = _PromptBatch(body.n, len(started))
        return batch.reindex(0, started[0][0]), batch.merged(started)

    async def _completion_prompt(self, body: CompletionRequest, raw_prompt: dict[str, Any]) -> ProcessedPrompt:
        if not body.media:
            return await self.serving.client.process(raw_prompt, body.mm_processor_kwargs)
        media = await self.serving.in_worker(resolve_media, body.media, self.serving.config.media,
                                             body.mm_processor_kwargs)
        raw_prompt["multi_modal_data"] = {"image": media.images, "video": media.videos, "audio": media.audios}
        raw_prompt["multi_modal_uuids"] = media.uuids
        return await self.serving.client.process(raw_prompt, body.mm_processor_kwargs, media.params)

    async def create(self, body: CompletionRequest, raw: Request) -> Any:
        """Answer one completion request: a JSON response, or a stream of chunks with `stream`."""
        arrival_time = time.time()
        model = self.serving.check_model(body.model)
        request_id = raw.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        raw_prompts = self._raw_prompts(body)
        if len(raw_prompts) == 1:
            with self.serving.traced("media_load", raw):
                prompt = await self._completion_prompt(body, raw_prompts[0])
            first, outputs = await self.serving.start(request_id, prompt, body, raw, arrival_time)
        else:
            first, outputs = await self._start_several(request_id, raw_prompts, body, raw, arrival_time)

        num_logprobs = body.requested_logprobs()
        echo = self._echo(num_logprobs, body) if body.echo else None

        def whole(final: RequestOutput) -> BaseModel:
            echoed, echoed_logprobs = echo(final) if echo else ("", None)
            choices = []
            for c in final.outputs:
                logprobs = None
                if num_logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, self.serving.names(c.logprobs, body), num_logprobs)
                    logprobs = joined(echoed_logprobs, logprobs) if echoed_logprobs else logprobs
                choices.append(CompletionChoice(
                    index=c.index, text=echoed + c.text, finish_reason=c.finish_reason, logprobs=logprobs,
                    prompt_logprobs=None if body.prompt_logprobs is None
                    else prompt_logprobs(self.serving.names(final.prompt_logprobs, body)),
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                    prompt_token_ids=list(final.prompt_token_ids) if body.return_token_ids else None))
            return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_of(final))

        return await self.serving.respond(request_id, model, body, raw, first, outputs, self._chunks, whole, echo)

    def _echo(self, num_logprobs: int | None,
              body: CompletionRequest) -> Callable[[RequestOutput], tuple[str, CompletionLogprobs | None]]:
        """The prompt's text as echoed, and its logprobs in the legacy shape (with logprobs)."""
        tokenizer = self.serving.client.frontend.processor.tokenizer

        def echo(output: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
            ids = output.prompt_token_ids
            text = output.prompt if output.prompt is not None else tokenizer.decode(ids, skip_special_tokens=False)
            if num_logprobs is None or output.prompt_logprobs is None:
                return text, None
            first = f"token_id:{ids[0]}" if self.serving.token_ids_named(body) else tokenizer.decode(
                ids[:1], skip_special_tokens=False)
            return text, echo_logprobs(ids, self.serving.names(output.prompt_logprobs, body), num_logprobs, first)
        return echo

    @staticmethod
    def _chunks(request_id: str, model: str, include_usage: bool, cursor: StreamCursor,
                output: RequestOutput) -> list[BaseModel]:
        """The chunks of the choice this output moved: its text (the echoed prompt first) and logprobs, its
        finish reason; the usage after the last."""
        completion = output.outputs[output.delta_index]
        index = completion.index
        finish = completion.finish_reason if cursor.finishes(completion) else None
        out: list[BaseModel] = []
        first = cursor.first_chunk(index)
        echoed, echoed_logprobs = cursor.echo(output) if cursor.echo and first else ("", None)
        token_ids, entries = cursor.take(completion)
        new_ids = cursor.take_ids(completion)
        if echoed or output.delta_text or finish is not None or entries or new_ids or (first and cursor.return_token_ids):
            logprobs = None
            if entries:
                logprobs = completion_logprobs(token_ids, entries, cursor.num_logprobs, cursor.text_offset.get(index, 0))
            if echoed_logprobs is not None:
                logprobs = joined(echoed_logprobs, logprobs) if logprobs else echoed_logprobs
            if logprobs is not None:
                cursor.text_offset[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            choice = CompletionChoice(index=index, text=echoed + output.delta_text, finish_reason=finish,
                                      logprobs=logprobs, token_ids=new_ids, prompt_token_ids=cursor.prompt_ids(output, first))
            out.append(CompletionResponse(id=request_id, model=model, choices=[choice],
                                          usage=choice_usage(output, len(completion.token_ids))
                                          if cursor.continuous_usage else None))
        if output.finished and include_usage:
            out.append(CompletionResponse(id=request_id, model=model, choices=[], usage=usage_of(output)))
        return out


def completions_router(serving: OpenAIServing) -> APIRouter:
    """The completions route (the app mounts it under /v1, behind the API key)."""
    endpoint = CompletionServing(serving)
    router = APIRouter()

    @router.post("/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await endpoint.create(body, raw)

    return router
