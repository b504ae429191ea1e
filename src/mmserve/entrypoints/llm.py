"""The offline API, vLLM-compatible: `LLM(model, **engine_args).generate(...)`, `.chat(...)` and `.beam_search(...)`;
with `runner="pooling"`, `.embed(...)` and `.score(...)`.

Role: validate and process every prompt first (bad input raises `InvalidInputError` before any
request is added, so nothing runs half-way), submit them all, step the engine until they finish,
and return outputs in input order. What it does not know: scheduling or model internals.
"""

from __future__ import annotations

import itertools
import sys
import time
import weakref
from collections.abc import Sequence
from typing import Any

from mmserve.config import EngineConfig, resolve_model
from mmserve.engine.beam_driver import run_offline
from mmserve.engine.llm_engine import Engine
from mmserve.entrypoints.pooling_prompts import carrier_params, pair_prompt, score_pairs, side_prompt
from mmserve.errors import InvalidInputError
from mmserve.faults import FaultPlan
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import (
    BeamSearchOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from mmserve.pooling import PoolingParams, cosine
from mmserve.sampling_params import BeamSearchParams, SamplingParams


class _Progress:
    """One stderr line, rewritten in place: requests done and output tokens per second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.tokens = total, enabled and total > 0, 0, 0
        self.started = time.perf_counter()

    def update(self, finished: int, tokens: int) -> None:
        self.done += finished
        self.tokens += tokens
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            sys.stderr.write(f"\rprocessed {self.done}/{self.total} requests, {rate:.1f} output tokens/s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


class LLM:
    def __init__(self, model: str | None = None, *, revision: str | None = None, faults: FaultPlan | None = None,
                 **engine_args: Any) -> None:
        """`model`: a checkpoint directory, or a Hugging Face repository id (`ORG/NAME`, at `revision`: from the
        local cache, else downloaded); None loads the bundled demo model. `faults`: a test's planted faults
        (mmserve/faults.py), never set in production."""
        self.engine = Engine(EngineConfig.from_kwargs(resolve_model(model, revision), **engine_args), faults)
        # an LLM dropped without `shutdown()` (a script's `del llm`, a second LLM in its place) still stops its
        # workers and background compile; runs at most once
        self._shutdown = weakref.finalize(self, self.engine.shutdown)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the checkpoint's generation_config.json defaults (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) unless the engine was built with
        generation_config="vllm"; what `generate` and `chat` use when given no sampling params."""
        defaults = self.engine.frontend.default_sampling
        return SamplingParams(**defaults) if defaults else SamplingParams()

    def _per_prompt_params(self, params: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise InvalidInputError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        self._require_runner("generate", "generate")
        processed = self._processed(prompts, mm_processor_kwargs)
        return self._run(processed, self._per_prompt_params(sampling_params, len(processed)), use_tqdm)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, mm_processor_kwargs: dict[str, Any] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or a list of conversations."""
        self._require_runner("generate", "chat")
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("messages must be a non-empty list of message dicts (or of conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        processed = []
        for i, conv in enumerate(conversations):
            try:
                processed.append(self.engine.process_chat(conv, mm_processor_kwargs, **(chat_template_kwargs or {})))
            except InvalidInputError as exc:
                raise exc.reworded(f"conversation {i}: {exc}") from exc
        return self._run(processed, self._per_prompt_params(sampling_params, len(processed)), use_tqdm)

    def beam_search(self, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best hypotheses, best first, as
        transformers' `generate(num_beams=..., num_return_sequences=...)` finds them (engine/beam_search.py).
        Prompts are what `generate` takes (text, token ids, media)."""
        self._require_runner("generate", "beam_search")
        if not isinstance(params, BeamSearchParams):
            raise InvalidInputError("params must be a mmserve.BeamSearchParams", param="params")
        del use_tqdm  # vLLM's argument; the search reports no progress
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        processed = []
        for i, raw in enumerate(prompt_list):
            try:
                prompt = self.engine.process(raw, mm_processor_kwargs)
            except InvalidInputError as exc:
                raise exc.reworded(f"prompt {i}: {exc}") from exc
            if prompt.num_tokens + params.max_tokens > self.engine.max_model_len:
                raise InvalidInputError(f"prompt {i}: its {prompt.num_tokens} tokens and max_tokens="
                                        f"{params.max_tokens} exceed the context ({self.engine.max_model_len} "
                                        "tokens)", param="max_tokens")
            processed.append(prompt)
        decode = self.engine.processor.tokenizer.decode
        return run_offline(self.engine, processed, params, decode, f"offline-{next(self._ids)}")

    # ---- a pooling engine (runner="pooling") ------------------------------------------------------
    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              mm_processor_kwargs: dict[str, Any] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (prompts as `generate` takes them: text, token ids,
        dicts with `multi_modal_data`), pooled as the engine's pooling says, `pooling_params.dimensions`
        (Matryoshka) and normalization applied."""
        pooling = self._require_runner("pooling", "embed")
        if pooling.task != "embed":
            raise InvalidInputError("this model scores pairs (a reranker): call score()", param="runner")
        params = pooling_params or PoolingParams()
        pooling.check_dimensions(params.dimensions, "pooling_params.dimensions")
        processed = self._processed(prompts, mm_processor_kwargs)
        outputs = self._run(processed, [carrier_params(params)] * len(processed), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(params.finish(pooling, _pooled(o))),
                                       o.prompt_token_ids) for o in outputs]

    def score(self, data_1: Any, data_2: Any, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one `data_1` against every `data_2`, or pairwise; each a string or
        `{"content": [parts]}` with images. A reranker scores each pair's prompt (pooling_prompts.pair_prompt);
        an embedding model the cosine of the two sides' embeddings."""
        pooling = self._require_runner("pooling", "score")
        params = pooling_params or PoolingParams()
        pairs = score_pairs(data_1, data_2)
        frontend = self.engine.frontend
        if pooling.task == "score":
            prompts = [pair_prompt(frontend, q, d, ("data_1", "data_2")) for q, d in pairs]
            outputs = self._run(prompts, [carrier_params(params)] * len(prompts), use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(params.finish(pooling, _pooled(o)))),
                                         o.prompt_token_ids) for o in outputs]
        sides = [side_prompt(frontend, datum, name) for pair in pairs for datum, name in zip(pair, ("data_1", "data_2"))]
        outputs = self._run(sides, [carrier_params(params)] * len(sides), use_tqdm)
        vectors = [params.finish(pooling, _pooled(o)) for o in outputs]
        return [ScoringRequestOutput(f"{outputs[2 * i].request_id}_{outputs[2 * i + 1].request_id}",
                                     ScoringOutput(cosine(vectors[2 * i], vectors[2 * i + 1])),
                                     outputs[2 * i].prompt_token_ids + outputs[2 * i + 1].prompt_token_ids)
                for i in range(len(pairs))]

    def _processed(self, prompts: Any, mm_processor_kwargs: dict[str, Any] | None) -> list[ProcessedPrompt]:
        """Every prompt processed before any runs: a bad one raises InvalidInputError naming its index."""
        processed = []
        for i, raw in enumerate([prompts] if isinstance(prompts, (str, dict)) else list(prompts)):
            try:
                processed.append(self.engine.process(raw, mm_processor_kwargs))
            except InvalidInputError as exc:
                raise exc.reworded(f"prompt {i}: {exc}") from exc
        return processed

    def _require_runner(self, runner: str, call: str) -> Any:
        """The engine's pooling (None for a generating engine), or InvalidInputError when `call` is not its."""
        if self.engine.config.runner != runner:
            raise InvalidInputError(f"LLM.{call}() needs runner={runner!r}; this LLM was built with runner="
                                    f"{self.engine.config.runner!r}", param="runner")
        return self.engine.frontend.pooling

    def _run(self, processed: list[ProcessedPrompt], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"offline-{next(self._ids)}" for _ in processed]
        for i, (rid, p) in enumerate(zip(ids, params)):
            try:
                self.engine.add_request(rid, processed[i], p)
            except BaseException:  # a later request refused: the ones added before it do not run either
                self.engine.abort_request(ids[:i])
                raise
        # the engine owns the prompts now and releases each item's pixels once it is encoded; a list
        # kept here would hold every request's pixels until the whole batch ends
        processed.clear()
        results: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids), use_tqdm)
        try:
            while len(results) < len(ids):
                outputs = self.engine.step()
                finished = [o for o in outputs if o.finished]
                results.update((o.request_id, o) for o in finished)
                progress.update(len(finished), sum(1 for o in outputs if o.outputs[0].token_ids))
        except BaseException:
            self.engine.abort_request([rid for rid in ids if rid not in results])
            raise
        return [results[rid] for rid in ids]

    def get_stats(self) -> dict[str, int | float | str]:
        return self.engine.get_stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def shutdown(self) -> None:
        """Stop the encoder workers, if any, and a background compile (`with LLM(...) as llm:` does it on exit,
        and dropping the LLM does it too)."""
        self._shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _pooled(output: RequestOutput) -> list[float]:
    """A finished pooling request's vector, or the error that finished it without one."""
    if output.pooled is None:
        raise RuntimeError(f"request {output.request_id} finished without a pooled vector: {output.error}")
    return output.pooled
