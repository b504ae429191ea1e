"""The pooling routes' bodies: OpenAI's embeddings, vLLM's score, and rerank as vLLM, Jina and Cohere spell it.

Role: request models (`EmbeddingRequest`: OpenAI's `input` or vLLM's `messages` form; `ScoreRequest`:
vLLM's `data_1`/`data_2`, also spelt `text_1`/`text_2` and `queries`/`documents`; `RerankRequest`:
`query`, `documents`, `top_n`, `return_documents`) and response models. Every field is used; any other is a
400 naming it (`extra="forbid"`).
What it does not know: the engine, pooling itself (mmserve/pooling.py), HTTP routing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.entrypoints.openai.protocol import NullMeansUnset, RequestError

ScoreInput = str | dict[str, Any]  # text, or {"content": [parts]} with images


class PoolingRequestBase(NullMeansUnset):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    user: str | None = None  # who asks (OpenAI's), never what is computed
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep a prompt's last N tokens
    use_activation: bool | None = None  # embeddings: L2-normalize; scores: the sigmoid (None: the model's)
    mm_processor_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(PoolingRequestBase):
    """OpenAI's `input` (a string, strings, token ids, or lists of token ids) or vLLM's `messages` (one
    conversation with images, rendered by the chat template)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's older name of use_activation
    add_generation_prompt: bool = False  # messages: vLLM's default for embeddings
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_form(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise RequestError("give exactly one of input and messages", param="input")

    def inputs(self) -> list[Any]:
        """The prompts to embed, as the engine takes them (text, or {"prompt_token_ids": ...})."""
        self.check_form()
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise RequestError("input must not be empty", param="input")
        if all(isinstance(v, int) for v in value):
            return [{"prompt_token_ids": list(value)}]
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, list) for v in value):
            return [{"prompt_token_ids": list(v)} for v in value]
        raise RequestError("input must be a string, a list of strings, token ids, or lists of token ids",
                           param="input")

    def activation(self) -> bool | None:
        return self.use_activation if self.use_activation is not None else self.normalize


class ScoreRequest(PoolingRequestBase):
    """vLLM's /score: `data_1` against `data_2` (or `text_1`/`text_2`, `queries`/`documents`)."""

    data_1: ScoreInput | list[ScoreInput] | None = None
    data_2: ScoreInput | list[ScoreInput] | None = None
    text_1: ScoreInput | list[ScoreInput] | None = None
    text_2: ScoreInput | list[ScoreInput] | None = None
    queries: ScoreInput | list[ScoreInput] | None = None
    documents: ScoreInput | list[ScoreInput] | None = None

    def sides(self) -> tuple[tuple[Any, str], tuple[Any, str]]:
        """((first, its field), (second, its field)) from whichever spelling the request used."""
        given = [(a, b) for a, b in (("data_1", "data_2"), ("text_1", "text_2"), ("queries", "documents"))
                 if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(given) != 1 or any(getattr(self, name) is None for name in given[0]):
            raise RequestError("give data_1 and data_2 (or text_1 and text_2, or queries and documents)",
                               param="data_1")
        first, second = given[0]
        return (getattr(self, first), first), (getattr(self, second), second)


class RerankRequest(PoolingRequestBase):
    """/rerank, /v1/rerank, /v2/rerank: vLLM's, Jina's and Cohere's (v1 and v2) request."""

    query: ScoreInput
    documents: list[ScoreInput]
    top_n: int | None = Field(default=None, ge=0)  # the best N (None or 0: all)
    return_documents: bool = True  # each result carries its document


class EmbeddingData(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32 bytes


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ListResponse(BaseModel):
    """OpenAI's list object: what /v1/embeddings and /v1/score answer around their data."""

    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")  # vLLM's prefix for both
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingData]


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str | None = None
    multi_modal: list[Any] | None = None


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
