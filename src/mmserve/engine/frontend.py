"""What an engine knows before it has weights: the family's processor, its spec and its stop tokens.

Role: from a checkpoint's config.json and tokenizer (no weights), build the processor that turns
user input into `ProcessedPrompt`s, the family's `FamilySpec`, the end-of-sequence ids and the
structured-output compiler, and process prompts and chats with them. The engine composes one; an
API server in front of many replicas holds one of its own, so that it processes, hashes and routes
a request before any replica sees it. `max_model_len` is the engine's (it depends on the KV cache):
the engine sets it, and a server in front of replicas takes the one they report.
It also holds the sampling defaults of the checkpoint's generation_config.json (`default_sampling`).
What it does not know: weights, the KV cache, scheduling, requests.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from pathlib import Path
from typing import Any

from mmserve.config import EngineConfig, resolve_model
from mmserve.engine.generation_defaults import generation_defaults
from mmserve.engine.prompts import parse_prompt
from mmserve.engine.structured_outputs import StructuredOutputs
from mmserve.errors import InvalidInputError
from mmserve.inputs.chat_template import read_chat_template_arg
from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.models.loader import generation_eos_ids, read_config
from mmserve.models.registry import resolve
from mmserve.pooling import Pooling, RerankerOverrides, resolve_pooling

logger = logging.getLogger("mmserve.engine")
_said_no_remote_code = False  # trust_remote_code is answered once per process


def _text_tokenizer(config: EngineConfig) -> TextTokenizer | None:
    """The tokenizer of vLLM's --tokenizer / --chat-template (None: the model's own, as found there)."""
    if config.tokenizer is None and config.chat_template is None:
        return None
    directory = resolve_model(config.tokenizer) if config.tokenizer else config.model
    template = read_chat_template_arg(config.chat_template) if config.chat_template is not None else None
    return TextTokenizer(directory, chat_template=template)


def _checked_processor_kwargs(frontend: Frontend, kwargs: Any) -> dict[str, Any]:
    """vLLM's --mm-processor-kwargs, checked once at start by processing a text prompt with them."""
    if not isinstance(kwargs, dict):
        raise InvalidInputError("mm_processor_kwargs must be a dict (JSON object)", param="mm_processor_kwargs",
                                setting="mm_processor_kwargs")
    try:
        frontend.processor.process("x", None, [], [], dict(kwargs))
    except InvalidInputError as exc:
        raise InvalidInputError(f"mm_processor_kwargs: {exc}", param="mm_processor_kwargs",
                                setting="mm_processor_kwargs") from exc
    return dict(kwargs)


def _classifier_ids(pooling: Pooling, tokenizer: TextTokenizer) -> tuple[int, int] | None:
    """A reranker's classifier tokens as ids (vLLM's: each a vocabulary token), or ValueError naming it."""
    if pooling.classifier_from_token is None:
        return None
    ids = []
    for token in pooling.classifier_from_token:
        found = tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"hf_overrides.classifier_from_token: {token!r} is not a token of the tokenizer")
        ids.append(found)
    return ids[0], ids[1]


def _answer_trust_remote_code(config: EngineConfig) -> None:
    global _said_no_remote_code
    if config.trust_remote_code and not _said_no_remote_code:
        _said_no_remote_code = True
        logger.info("trust_remote_code: accepted, but mmserve runs no code from a checkpoint (its model "
                    "families are built in)")


class Frontend:
    def __init__(self, config: EngineConfig, model_config: Any | None = None) -> None:
        """`model_config`: the family's parsed config where a model was built from it (else parsed here)."""
        raw = read_config(config.model)
        family = resolve(raw)
        model_config = family.parse_config(raw) if model_config is None else model_config
        self.config = config
        _answer_trust_remote_code(config)
        self.processor = family.processor_class(Path(config.model), model_config, config.media,
                                                tokenizer=_text_tokenizer(config))
        self.spec = family.build_spec(model_config, self.processor, config.media)
        eos = set(self.spec.eos_token_ids) | set(generation_eos_ids(config.model))
        if self.processor.tokenizer.eos_token_id is not None:
            eos.add(self.processor.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.structured = StructuredOutputs(self.processor.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        self.max_model_len: int | None = None
        # SamplingParams field -> the checkpoint's default, for a request that leaves the field unset
        self.default_sampling: dict[str, Any] = generation_defaults(config.model, config.generation_config)
        # a pooling engine's pooling (mmserve/pooling.py), and a reranker's (no, yes) token ids; None: it generates
        self.pooling = None if config.runner != "pooling" else resolve_pooling(
            config.model, self.spec.embed_dim, config.pooler_config, RerankerOverrides.parse(config.hf_overrides))
        self.classifier_token_ids = None if self.pooling is None else _classifier_ids(self.pooling,
                                                                                      self.processor.tokenizer)
        self.default_processor_kwargs: dict[str, Any] = {}
        if config.mm_processor_kwargs:
            self.default_processor_kwargs = _checked_processor_kwargs(self, config.mm_processor_kwargs)

    def process(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None,
                item_params: dict[str, list[str]] | None = None) -> ProcessedPrompt:
        """`item_params`: the request fields the media items came from (errors name them)."""
        p = parse_prompt(raw_prompt, self._with_default_kwargs(mm_processor_kwargs))
        processed = self.processor.process(p.prompt, p.prompt_token_ids, p.images, p.videos, p.mm_processor_kwargs,
                                           p.uuids, item_params, audios=p.audios)
        processed.cache_salt = p.cache_salt
        return processed

    def process_chat(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                     **template_kwargs: Any) -> ProcessedPrompt:
        chat = self.processor.render_chat(messages, **{**(self.config.default_chat_template_kwargs or {}),
                                                       **template_kwargs})
        return self.processor.process(chat.prompt, None, chat.images, chat.videos,
                                      self._with_default_kwargs(mm_processor_kwargs), chat.uuids, chat.params,
                                      audios=chat.audios)

    def _with_default_kwargs(self, given: Any) -> Any:
        """A request's mm_processor_kwargs over the engine's defaults (a non-dict is left for the check)."""
        if not self.default_processor_kwargs or (given is not None and not isinstance(given, dict)):
            return given
        return {**self.default_processor_kwargs, **(given or {})}

    async def process_off_loop(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None,
                               item_params: dict[str, list[str]] | None = None) -> ProcessedPrompt:
        """`process` in the running loop's default executor (a server's callers never block the loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.process, raw_prompt, mm_processor_kwargs, item_params)

    async def process_chat_off_loop(self, messages: list[dict[str, Any]],
                                    mm_processor_kwargs: dict[str, Any] | None = None,
                                    **template_kwargs: Any) -> ProcessedPrompt:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, partial(self.process_chat, messages, mm_processor_kwargs,
                                                        **template_kwargs))

    def close(self) -> None:
        self.structured.close()
