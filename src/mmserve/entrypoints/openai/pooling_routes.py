"""The pooling routes: POST /v1/embeddings (OpenAI's), /v1/score and /score (vLLM's), and /rerank, /v1/rerank
and /v2/rerank (vLLM's, Jina's, Cohere's), served by an engine started with `--runner pooling`.

Role: turn each body into prompts (text and token ids as the engine takes them; messages and score sides
with images through the server's media rules, then the chat template: entrypoints/pooling_prompts.py), run
them as one pooling request each over the `EngineClient` (concurrently: the scheduler batches them), and
make the vectors embeddings (Matryoshka `dimensions`, normalization, float or base64) or scores (a
reranker's relevance; an embedding model's cosine). `runner_guard`: the dependency that answers a route of
the other runner with a 400 saying which runner serves it (a generating server refuses these; a pooling
server refuses generation).
What it does not know: the engine behind the client, pooling's arithmetic (mmserve/pooling.py).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from mmserve.entrypoints.openai.media import resolve_messages
from mmserve.entrypoints.openai.pooling_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.serving import (
    OpenAIServing,
    last_output,
    raise_if_failed,
    unless_disconnected,
)
from mmserve.entrypoints.pooling_prompts import carrier_params, pair_prompt, score_pairs, side_prompt, text_of
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.pooling import Pooling, PoolingParams, cosine


def runner_guard(serving: OpenAIServing, runner: str) -> Callable[[Request], Any]:
    """A route dependency: a 400 naming the runner that serves the route when the engine runs the other."""
    async def check(request: Request) -> None:
        running = serving.client.frontend.config.runner
        if running != runner:
            raise RequestError(f"{request.url.path} is served by an engine started with --runner {runner}; this "
                               f"server runs --runner {running}", code="wrong_runner")
    return check


class PoolingServing:
    """The pooling routes over the shared core."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @property
    def pooling(self) -> Pooling:
        pooling = self.serving.client.frontend.pooling
        assert pooling is not None, "a pooling route ran on a generating engine (runner_guard lets none through)"
        return pooling

    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        model = self.serving.check_model(body.model)
        pooling = self.pooling
        if pooling.task != "embed":
            raise RequestError("this model is a reranker: it serves /v1/score and /v1/rerank", param="input")
        params = PoolingParams(pooling.check_dimensions(body.dimensions), body.activation(),
                               body.truncate_prompt_tokens)
        body.check_form()
        if body.messages is not None:
            messages = await self.serving.in_worker(resolve_messages, body.messages, self.serving.config.media,
                                                    body.mm_processor_kwargs)
            prompts = [await self.serving.client.process_chat(
                messages, body.mm_processor_kwargs, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, **(body.chat_template_kwargs or {}))]
        else:
            prompts = [await self.serving.client.process(p, body.mm_processor_kwargs) for p in body.inputs()]
        outputs = await self._run(prompts, params, raw)
        data = [EmbeddingData(index=i, embedding=_encoded(params.finish(pooling, o.pooled), body.encoding_format))
                for i, o in enumerate(outputs)]
        return EmbeddingResponse(model=model, data=data, usage=_usage(outputs)).model_dump()

    async def score(self, body: ScoreRequest, raw: Request) -> dict[str, Any]:
        model = self.serving.check_model(body.model)
        (first, name_1), (second, name_2) = body.sides()
        scores, outputs = await self._scores(first, second, (name_1, name_2), body, raw)
        return ScoreResponse(model=model, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=_usage(outputs)).model_dump()

    async def rerank(self, body: RerankRequest, raw: Request) -> dict[str, Any]:
        model = self.serving.check_model(body.model)
        if not body.documents:
            raise RequestError("documents must not be empty", param="documents")
        scores, outputs = await self._scores(body.query, body.documents, ("query", "documents"), body, raw)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=_document(body.documents[i]) if body.return_documents else None)
                   for i in order]
        return RerankResponse(model=model, usage=_usage(outputs), results=results).model_dump(exclude_none=True)

    async def _scores(self, first: Any, second: Any, names: tuple[str, str], body: Any,
                      raw: Request) -> tuple[list[float], list[RequestOutput]]:
        """Each pair's score: a reranker's relevance of its prompt, or the cosine of the sides' embeddings."""
        pairs = score_pairs(first, second, *names)
        pooling, frontend = self.pooling, self.serving.client.frontend
        params = PoolingParams(None, body.use_activation, body.truncate_prompt_tokens)
        wheres = [tuple(f"{name}[{i}]" if isinstance(data, list) else name
                        for name, data in zip(names, (first, second))) for i in range(len(pairs))]
        resolved = [(await self._resolved(q, where[0]), await self._resolved(d, where[1]))
                    for (q, d), where in zip(pairs, wheres)]
        if pooling.task == "score":
            prompts = [await self.serving.in_worker(pair_prompt, frontend, q, d, where)
                       for (q, d), where in zip(resolved, wheres)]
            outputs = await self._run(prompts, params, raw)
            return [float(params.finish(pooling, o.pooled)) for o in outputs], outputs
        sides = [await self.serving.in_worker(side_prompt, frontend, datum, name)
                 for pair, where in zip(resolved, wheres) for datum, name in zip(pair, where)]
        outputs = await self._run(sides, params, raw)
        vectors = [params.finish(pooling, o.pooled) for o in outputs]
        return [cosine(vectors[2 * i], vectors[2 * i + 1]) for i in range(len(pairs))], outputs

    async def _resolved(self, datum: Any, where: str) -> Any:
        """A score side with its media fetched and decoded under the server's rules (text stays text)."""
        if isinstance(datum, str) or text_of(datum, where) is not None:
            return datum
        try:
            message = await self.serving.in_worker(resolve_messages, [{"role": "user", "content": datum["content"]}],
                                                   self.serving.config.media, None)
        except InvalidInputError as exc:
            param = (exc.param or "").replace("messages[0]", where)
            raise InvalidInputError(str(exc).replace("messages[0]", where), param=param or where) from exc
        return {"content": message[0]["content"]}

    async def _run(self, prompts: list[ProcessedPrompt], params: PoolingParams, raw: Request) -> list[RequestOutput]:
        """One pooling request per prompt, all at once; their finished outputs in order."""
        client, prefix = self.serving.client, f"pool-{uuid.uuid4().hex}"
        trace_parent = getattr(raw.state, "trace_parent", None)

        async def one(i: int, prompt: ProcessedPrompt) -> RequestOutput:
            return await last_output(client.generate(f"{prefix}-{i}", prompt, carrier_params(params),
                                                     restartable=True, trace_parent=trace_parent))

        outputs = await unless_disconnected(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), raw)
        for output in outputs:
            raise_if_failed(output)
        return list(outputs)


def _encoded(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what OpenAI's SDK decodes: little-endian float32
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def _usage(outputs: list[RequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _document(datum: Any) -> RerankDocument:
    if isinstance(datum, str):
        return RerankDocument(text=datum)
    return RerankDocument(multi_modal=list(datum.get("content") or []))


def pooling_router(serving: OpenAIServing) -> tuple[APIRouter, APIRouter]:
    """(routes under /v1, routes at the root)."""
    pooling = PoolingServing(serving)
    v1, root = APIRouter(), APIRouter()

    async def embeddings(body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        return await pooling.embeddings(body, raw)

    async def score(body: ScoreRequest, raw: Request) -> dict[str, Any]:
        return await pooling.score(body, raw)

    async def rerank(body: RerankRequest, raw: Request) -> dict[str, Any]:
        return await pooling.rerank(body, raw)

    v1.add_api_route("/embeddings", embeddings, methods=["POST"])
    v1.add_api_route("/score", score, methods=["POST"])
    v1.add_api_route("/rerank", rerank, methods=["POST"])
    root.add_api_route("/score", score, methods=["POST"])
    root.add_api_route("/rerank", rerank, methods=["POST"])
    root.add_api_route("/v2/rerank", rerank, methods=["POST"])
    return v1, root
