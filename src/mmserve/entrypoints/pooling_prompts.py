"""A pooling engine's prompts: what an embedding or a score is computed over, for the offline API and the server.

Role: score inputs as vLLM takes them (`data_1`/`data_2`, or a query and documents: each a string or
`{"content": [parts]}` with text and images; one query against many, or pairs) -> the pairs; one side ->
its prompt (text as text, content with media through the chat template as one user message, no generation
prompt); a pair -> a reranker's prompt (with `--chat-template`, the template rendered over a "query" and a
"document" message, as vLLM renders a score template; without, the query's text then the document's, as
vLLM joins them for an LLM-as-reranker); `POOLING_CARRIER`: the engine parameters a pooling request runs
with (its one prompt pass: nothing is sampled). The `/v1/embeddings` input forms are the server's.
What it does not know: the engine's steps, HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mmserve.engine.frontend import Frontend
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.pooling import PoolingParams
from mmserve.sampling_params import SamplingParams


def carrier_params(params: PoolingParams | None) -> SamplingParams:
    """The engine parameters of a pooling request: one prompt pass (`max_tokens` 1 reserves no more KV than
    the prompt's), its truncation; the runner pools instead of sampling."""
    truncate = None if params is None else params.truncate_prompt_tokens
    return SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate)


def score_pairs(data_1: Any, data_2: Any, param_1: str = "data_1", param_2: str = "data_2") -> list[tuple[Any, Any]]:
    """vLLM's pairing: one first entry scored against every second one, or as many of each, pairwise."""
    first, second = _entries(data_1, param_1), _entries(data_2, param_2)
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidInputError(f"{param_1} has {len(first)} entries and {param_2} {len(second)}: give one "
                                f"{param_1} or as many as {param_2}", param=param_1)
    return list(zip(first, second))


def side_prompt(frontend: Frontend, datum: Any, param: str) -> ProcessedPrompt:
    """One side of a pair (an embedding model scores the two sides' embeddings)."""
    text = text_of(datum, param)
    if text is not None:
        return frontend.process(text)
    with _fields_named((param,)):
        return frontend.process_chat([{"role": "user", "content": parts_of(datum, param)}],
                                     add_generation_prompt=False)


def pair_prompt(frontend: Frontend, query: Any, document: Any, params: tuple[str, str]) -> ProcessedPrompt:
    """A reranker's prompt for one (query, document) pair; `params`: the fields each came from."""
    if frontend.config.chat_template is not None:
        messages = [{"role": "query", "content": _content(query, params[0])},
                    {"role": "document", "content": _content(document, params[1])}]
        with _fields_named(params):
            return frontend.process_chat(messages, add_generation_prompt=False)
    texts = text_of(query, params[0]), text_of(document, params[1])
    for text, param in zip(texts, params):
        if text is None:
            raise InvalidInputError("scoring images with a reranker needs its score template: start mmserve "
                                    "with --chat-template (a template over 'query' and 'document' messages)",
                                    param=param)
    return frontend.process(texts[0] + texts[1])


def text_of(datum: Any, param: str) -> str | None:
    """A side's text when it holds only text (None: it holds media)."""
    if isinstance(datum, str):
        return datum
    parts = parts_of(datum, param)
    if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        return "".join(str(p.get("text", "")) for p in parts)
    return None


def parts_of(datum: Any, param: str) -> list[Any]:
    if isinstance(datum, str):
        return [{"type": "text", "text": datum}]
    if isinstance(datum, dict) and isinstance(datum.get("content"), list) and datum["content"]:
        return list(datum["content"])
    raise InvalidInputError("expected a string or an object with a non-empty 'content' list of parts "
                            f"(text, image_url), got {datum!r:.80}", param=param)


@contextmanager
def _fields_named(params: Sequence[str]) -> Iterator[None]:
    """An error about the chat messages a pair became, reworded to name the request's fields."""
    try:
        yield
    except InvalidInputError as exc:
        message, param = str(exc), exc.param or ""
        for i, name in enumerate(params):
            message = message.replace(f"messages[{i}]", name)
            param = param.replace(f"messages[{i}]", name)
        raise InvalidInputError(message, param=param or params[-1]) from exc


def _content(datum: Any, param: str) -> str | list[Any]:
    text = text_of(datum, param)
    return text if text is not None else parts_of(datum, param)


def _entries(data: Any, param: str) -> list[Any]:
    entries = [data] if isinstance(data, (str, dict)) else list(data) if isinstance(data, Sequence) else None
    if not entries:
        raise InvalidInputError("expected a string, an object with 'content', or a non-empty list of them",
                                param=param)
    return entries
