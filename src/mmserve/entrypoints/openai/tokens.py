"""Tokens: vLLM's POST /tokenize and /detokenize, GET /version, and GET /tokenizer_info where asked for.

Role: clients count a prompt's tokens before sending it: /tokenize gives the token ids exactly as
/v1/completions (`prompt`) or /v1/chat/completions (`messages`, with their `tools`) would run them —
pictures expanded to their placeholder rows, the chat template applied — and with `return_token_strs`
each token's string (vLLM's `token_strs`); /detokenize turns ids back into text, special tokens kept.
What it does not know: the engine behind the client, generation, authentication.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from mmserve.entrypoints.openai.media import resolve_messages
from mmserve.entrypoints.openai.protocol import NullMeansUnset, RequestError
from mmserve.entrypoints.openai.serving import OpenAIServing
from mmserve.entrypoints.openai.tool_formats import tool_format
from mmserve.entrypoints.openai.tools import parse_tools, parsed_tool_arguments
from mmserve.errors import InvalidInputError, out_of_vocabulary


class TokenizeRequest(NullMeansUnset):
    """vLLM's /tokenize: a completion prompt, or chat messages (their pictures expanded to placeholder rows)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # mmserve adds no special token to a prompt (a chat template writes its own): false is what it does; true
    # is refused with messages, where vLLM would add a BOS on top of the template's, which no route does here
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # also each token's string (vLLM's `token_strs`)
    tools: list[Any] | None = None  # messages: the tools the chat template renders, as chat's `tools`
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(NullMeansUnset):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokensServing:
    """/tokenize and /detokenize over the shared core."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """The prompt's token ids exactly as /v1/completions (`prompt`) or /v1/chat/completions (`messages`)
        would run them: pictures expanded to their placeholder rows, the chat template applied."""
        self.serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            if body.tools is not None:
                raise RequestError("tools are rendered by the chat template: give them with messages", param="tools")
            prompt = await self.serving.client.process({"prompt": body.prompt}, body.mm_processor_kwargs)
        else:
            if body.add_special_tokens:
                raise RequestError("add_special_tokens=true is not supported with messages: the chat template "
                                   "writes them", param="add_special_tokens", code="unsupported_parameter")
            try:
                tools = parse_tools(body.tools, None, None)
            except InvalidInputError as exc:
                raise RequestError(str(exc), param=exc.param) from exc
            tokenizer = self.serving.client.frontend.processor.tokenizer
            if tools is not None and tool_format(tokenizer.chat_template, self.serving.config.tool_call_parser) is None:  # as chat refuses them
                raise RequestError("this model's chat template renders no tools", param="tools",
                                   code="unsupported_parameter")
            messages = await self.serving.in_worker(resolve_messages, parsed_tool_arguments(body.messages), self.serving.config.media,
                                                    body.mm_processor_kwargs)
            prompt = await self.serving.client.process_chat(
                messages, body.mm_processor_kwargs, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **({} if tools is None else {"tools": list(tools.template_tools)}))
        ids = list(prompt.prompt_token_ids)
        tokenizer = self.serving.client.frontend.processor.tokenizer
        return TokenizeResponse(count=len(ids), max_model_len=self.serving.max_model_len, tokens=ids,
                                token_strs=[tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs
                                else None)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The ids' text, special tokens kept; an id outside the vocabulary is a 400."""
        self.serving.check_model(body.model)
        tokenizer = self.serving.client.frontend.processor.tokenizer
        vocab_size = self.serving.client.frontend.spec.vocab_size
        if message := out_of_vocabulary(body.tokens, vocab_size, shown=10):
            raise RequestError(f"tokens: {message}", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


def tokens_router(serving: OpenAIServing) -> APIRouter:
    """/tokenize, /detokenize, /version and (with the flag) /tokenizer_info; the app mounts them at the root,
    behind the API key."""
    endpoint = TokensServing(serving)
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await endpoint.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return endpoint.detokenize(body)

    @router.get("/version")
    async def version() -> dict[str, str]:
        from mmserve import __version__

        return {"version": __version__}

    if serving.config.tokenizer_info:
        @router.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return serving.client.frontend.processor.tokenizer.info()

    return router
