"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, and
`GET /v1/responses/{id}/input_items`.

Role: `ResponsesServing` checks a request (responses_protocol.py), puts the stored conversation that
`previous_response_id` names (responses_store.py) before its input, turns the whole into a chat request
(responses_input.py: messages, tools, tool_choice, response_format, max_tokens, temperature, top_p) and runs
it through `ChatServing.submit` — so a conversation is the same prompt and, greedy, the same answer as on
the chat route — then answers with the Response object (its items: reasoning, message, function calls) or
its event stream (responses_stream.py), and stores it where `store` is true. Errors name the request's
fields (`input[1].content[0].image_url`, `text.format`), not the chat's they came from.
What it does not know: templates, media loading, the engine behind the client, authentication.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mmserve.engine.client import EngineDeadError
from mmserve.entrypoints.openai.chat import ChatCompletionRequest, ChatServing, SubmittedChat
from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.responses_input import (
    ChatSources,
    canonical_items,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
)
from mmserve.entrypoints.openai.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)
from mmserve.entrypoints.openai.responses_store import (
    ChainTooDeep,
    ResponseNotStored,
    ResponseStore,
    StoredResponse,
)
from mmserve.entrypoints.openai.responses_stream import ResponseEvents, output_items
from mmserve.entrypoints.openai.serving import (
    OpenAIServing,
    last_output,
    raise_if_failed,
    unless_disconnected,
)
from mmserve.entrypoints.openai.streaming import failed
from mmserve.entrypoints.openai.tools import ToolCall
from mmserve.errors import InvalidInputError
from mmserve.inputs.chat_template import THOUGHT_CLOSE, thought_tag_pair
from mmserve.outputs import RequestOutput

# the chat request's fields as the Responses request names them (errors name the client's field)
CHAT_FIELDS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "messages": "input", "chat_template_kwargs": "reasoning.effort"}
MAX_LIST_LIMIT = 100


@contextlib.contextmanager
def client_field_names(sources: ChatSources) -> Iterator[None]:
    """Errors raised inside about the chat request, re-raised naming the Responses request's fields."""
    def text(message: str) -> str:
        return sources.rename(message).replace("response_format", "text.format").replace(
            "max_completion_tokens", "max_output_tokens")

    def param(name: str | None) -> str | None:
        return None if name is None else CHAT_FIELDS.get(name, sources.rename(name))
    try:
        yield
    except RequestError as exc:
        raise RequestError(text(exc.message), exc.status_code, exc.type, param(exc.param), exc.code) from exc
    except InvalidInputError as exc:
        renamed = exc.reworded(text(str(exc)))
        renamed.param = param(exc.param)
        raise renamed from exc


def reasoning_tokens(decode: Any, token_ids: list[int], close: str = THOUGHT_CLOSE) -> int:
    """How many of the generated tokens are the thought: up to the one that completes its closing tag
    `close` (all of them where it never closes)."""
    if close not in decode(token_ids):
        return len(token_ids)
    low, high = 1, len(token_ids)  # the shortest prefix whose text holds the closing tag
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if close in decode(token_ids[:middle]) else (middle + 1, high)
    return low


class ResponsesServing:
    """The Responses routes over the shared core and the chat route's submission, with the app's store."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store
        self.chat = ChatServing(serving)

    def stored(self, response_id: str, param: str) -> StoredResponse:
        try:
            return self.store.get(response_id)
        except ResponseNotStored as exc:
            raise RequestError(str(exc), status_code=404, param=param, code="response_not_found") from exc

    def _chat_request(self, body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        fields: dict[str, Any] = {
            "model": body.model, "messages": messages, "stream": body.stream, "tools": chat_tools(body.tools),
            "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": chat_response_format(body.text_format), "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p}
        template = self.serving.client.frontend.processor.tokenizer.chat_template
        if body.reasoning_effort == "none" and thought_tag_pair(template) is not None:
            if "enable_thinking" not in template:
                raise RequestError("reasoning.effort 'none' cannot be honoured: this model's chat template always "
                                   "thinks", param="reasoning.effort", code="unsupported_parameter")
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    async def create(self, body: ResponsesRequest, raw: Request) -> Any:
        """Answer one request: the Response object, or its event stream with `stream`."""
        body.check_fields()
        model = self.serving.check_model(body.model)
        previous = None if body.previous_response_id is None else self.stored(body.previous_response_id,
                                                                              "previous_response_id")
        try:
            chain_depth = self.store.chain_depth_after(previous)
        except ChainTooDeep as exc:
            raise RequestError(str(exc), param="previous_response_id") from exc
        assert body.input is not None  # check_fields
        items = canonical_items(body.input)
        history = [] if previous is None else previous.conversation
        messages, sources = chat_messages(body.instructions, history, items, isinstance(body.input, str))
        response_id = new_id("resp")
        with client_field_names(sources):
            chat = self._chat_request(body, messages)
            submitted = await self.chat.submit(chat, raw, response_id)
        snapshot = partial(self._response, body, model, response_id, int(time.time()))
        keep = partial(self._keep, body, response_id, [*history, *items], chain_depth)
        if body.stream:
            tools = submitted.tools if submitted.tools is not None and submitted.tools[0].choice != "none" else None
            events = ResponseEvents(snapshot, tools, submitted.in_thought)
            return StreamingResponse(self._events(events, submitted, keep), media_type="text/event-stream")
        first, outputs = submitted.first, submitted.outputs
        final = first if first.finished else await unless_disconnected(last_output(outputs), raw)
        raise_if_failed(final)
        completion = final.outputs[0]
        message, _ = ChatServing.message_of(completion, submitted.tools, submitted.in_thought)
        calls = [ToolCall(c.id, c.function.name or "", c.function.arguments or "") for c in message.tool_calls or ()]
        response = snapshot("incomplete" if completion.finish_reason == "length" else "completed",
                            output_items(message.reasoning, message.content, calls, completion.finish_reason), final)
        keep(response)
        return JSONResponse(response.model_dump())

    def _response(self, body: ResponsesRequest, model: str, response_id: str, created_at: int, status: str,
                  output: list[OutputItem], final: RequestOutput | None) -> ResponseObject:
        """The Response object as it stands: what was generated, and the request's settings echoed."""
        defaults = self.serving.client.frontend.default_sampling
        done = status in ("completed", "incomplete")
        return ResponseObject(
            id=response_id, created_at=created_at, status=status, completed_at=int(time.time()) if done else None,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, model=model, output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
            prompt_cache_key=body.prompt_cache_key, reasoning={"effort": body.reasoning_effort, "summary": None},
            safety_identifier=body.safety_identifier,
            temperature=body.temperature if body.temperature is not None else defaults.get("temperature", 1.0),
            text={"format": body.text_format}, tool_choice=body.tool_choice or "auto",
            tools=[{"type": "function", **{k: t.get(k) for k in ("name", "description", "parameters", "strict")}}
                   for t in body.tools or ()],
            top_p=body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
            usage=None if final is None else self._usage(final, output), user=body.user,
            metadata=body.metadata or {})

    def _usage(self, final: RequestOutput, output: list[OutputItem]) -> ResponseUsage:
        token_ids = list(final.outputs[0].token_ids)
        thought = any(item.type == "reasoning" for item in output)
        tokenizer = self.serving.client.frontend.processor.tokenizer
        decode = partial(tokenizer.decode, skip_special_tokens=False)
        num_input, num_output, num_cached = len(final.prompt_token_ids), len(token_ids), final.num_cached_tokens or 0
        cache = self.serving.client.frontend.config.cache
        num_written = num_input // cache.block_size * cache.block_size - num_cached if cache.enable_prefix_caching else 0
        return ResponseUsage(input_tokens=num_input,
                             input_tokens_details=InputTokensDetails(cached_tokens=num_cached,
                                                                     cache_write_tokens=max(0, num_written)),
                             output_tokens=num_output,
                             output_tokens_details=OutputTokensDetails(
                                 reasoning_tokens=reasoning_tokens(decode, token_ids, self._thought_close())
                                 if thought else 0),
                             total_tokens=num_input + num_output)

    def _thought_close(self) -> str:
        """The closing tag of this model's thoughts."""
        tags = thought_tag_pair(self.serving.client.frontend.processor.tokenizer.chat_template)
        return tags[1] if tags is not None else THOUGHT_CLOSE

    def _keep(self, body: ResponsesRequest, response_id: str, input_items: list[dict[str, Any]], chain_depth: int,
              response: ResponseObject) -> None:
        if body.store:
            self.store.put(response_id, response.model_dump(), input_items, chain_depth)

    async def _events(self, events: ResponseEvents, submitted: SubmittedChat, keep: Any) -> AsyncIterator[str]:
        """The stream's SSE lines; closing it (the client went away) closes the outputs, which aborts the
        request. A request the engine fails midway ends with `response.failed`."""
        async with contextlib.aclosing(submitted.outputs) as outputs:
            for event in events.start():
                yield event.sse()
            output = submitted.first
            try:
                while not failed(output):
                    for event in events.update(output):
                        yield event.sse()
                    if output.finished:
                        assert events.final is not None
                        keep(events.final)
                        return
                    output = await anext(outputs)
                yield events.failed(output.error or "the request failed").sse()
            except EngineDeadError as exc:
                yield events.failed(str(exc)).sse()

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """`GET /v1/responses/{id}/input_items`: the stored conversation's input items, as a list object."""
        items = [listed_item(item) for item in self.stored(response_id, "response_id").input_items]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise RequestError(f"after {after!r:.80} is no input item of {response_id}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as `/input_items` lists it (a message's text content as one input_text part)."""
    if item["type"] == "message" and isinstance(item["content"], str):
        return {**item, "content": [{"type": "input_text", "text": item["content"]}]}
    return item


def _no_query(raw: Request, allowed: tuple[str, ...] = ()) -> None:
    for name, value in raw.query_params.items():
        if name not in allowed and not (name == "stream" and value == "false"):
            raise RequestError(f"query parameter {name!r:.40} is not supported here", param=name,
                               code="unsupported_parameter")


def responses_router(serving: OpenAIServing, store: ResponseStore | None = None) -> APIRouter:
    """The Responses routes (the app mounts them under /v1, behind the API key); `store`: where stored
    responses live (None: a new store with the default limits, owned by this router and so by its app)."""
    endpoint = ResponsesServing(serving, store if store is not None else ResponseStore())
    router = APIRouter()

    @router.post("/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        return await endpoint.create(body, raw)

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str, raw: Request) -> Any:
        _no_query(raw)
        return JSONResponse(endpoint.stored(response_id, "response_id").response)

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        endpoint.stored(response_id, "response_id")
        endpoint.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.get("/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, raw: Request, limit: int = 20,
                               order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Any:
        _no_query(raw, ("limit", "order", "after"))
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise RequestError(f"limit must be in [1, {MAX_LIST_LIMIT}], got {limit}", param="limit")
        return JSONResponse(endpoint.input_items(response_id, limit, order, after))

    return router
