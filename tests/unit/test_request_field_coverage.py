"""Every field a request may carry is exercised by a named test: no field is accepted and silently ignored.

The walk: every pydantic model of `mmserve.entrypoints.openai` is either a response model (listed in
`RESPONSE_MODELS`) or a request model, and every field a request model declares, plus every field the
routes take undeclared (`UNSUPPORTED_FIELDS`, the routes' `route_unsupported_fields`, `GUIDED_FIELDS`,
`IDENTITY_FIELDS`), has an entry in `FIELD_TESTS`: the tests that show it changes the answer or is refused
with a 400 naming it. Each entry is checked: the test exists, and its source names the field (a test
parametrized over one of those tables names the table). A new field without an entry, an entry for a field
that no longer exists, a model no one classified, a renamed or deleted test: each fails here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

from pydantic import BaseModel

import mmserve.entrypoints.openai as openai_package
from mmserve.entrypoints.openai import protocol

ROOT = Path(__file__).resolve().parents[2]
RESPONSE_MODELS = {
    "ErrorInfo", "ErrorResponse", "PromptTokensDetails", "Usage", "TopLogprob", "TokenLogprob", "ChatLogprobs",
    "CompletionLogprobs", "PromptLogprob", "FunctionCall", "ToolCallModel", "DeltaToolCall", "ChatMessage",
    "ChatChoice", "ChatCompletionResponse", "DeltaMessage", "ChatChunkChoice", "ChatCompletionChunk",
    "CompletionChoice", "CompletionResponse", "ModelCard", "ModelList", "TokenizeResponse", "DetokenizeResponse",
    "DemoSample", "WebUIConfig",
}
BASE_MODELS = {"NullMeansUnset", "WireModel"}  # bases that declare no field of their own
RF = "tests/models/test_request_fields.py::"
SRV = "tests/e2e/test_server.py::"
BEAM = "tests/models/test_beam_search.py::"
CONF = "tests/models/test_server_conformance.py::"
UNSUPPORTED = [RF + "test_unsupported_fields_are_refused_unless_neutral"]
ROUTE = [RF + "test_route_unsupported_fields"]
# "Model.field" (the model that declares it) or "extra.field" (taken undeclared) -> the tests that exercise it
FIELD_TESTS: dict[str, list[str]] = {
    "GenerationRequest.model": [RF + "test_model_names_the_served_model"],
    "GenerationRequest.max_tokens": [SRV + "test_chat_matches_offline_llm"],
    "GenerationRequest.temperature": [RF + "test_sampling_fields_change_the_answer"],
    "GenerationRequest.top_p": [RF + "test_sampling_fields_change_the_answer"],
    "GenerationRequest.top_k": [RF + "test_sampling_fields_change_the_answer"],
    "GenerationRequest.min_p": [RF + "test_sampling_fields_change_the_answer"],
    "GenerationRequest.seed": [RF + "test_sampling_fields_change_the_answer", SRV + "test_n_choices_whole_and_streamed"],
    "GenerationRequest.stop": [RF + "test_stop_strings_and_special_tokens_in_the_text"],
    "GenerationRequest.stop_token_ids": [RF + "test_sampling_fields_change_the_answer"],
    "GenerationRequest.n": [SRV + "test_n_choices_whole_and_streamed"],
    "GenerationRequest.stream": [SRV + "test_streaming_chat_equals_non_streaming"],
    "GenerationRequest.stream_options": [SRV + "test_streaming_chat_equals_non_streaming"],
    "GenerationRequest.min_tokens": [SRV + "test_twenty_concurrent_clients"],
    "GenerationRequest.ignore_eos": [RF + "test_ignore_eos_runs_past_the_eos"],
    "GenerationRequest.skip_special_tokens": [RF + "test_stop_strings_and_special_tokens_in_the_text"],
    "GenerationRequest.include_stop_str_in_output": [RF + "test_stop_strings_and_special_tokens_in_the_text"],
    "GenerationRequest.mm_processor_kwargs": [SRV + "test_mm_processor_kwargs_change_the_prompt"],
    "GenerationRequest.presence_penalty": [SRV + "test_penalties_bias_and_masks_are_the_offline_ones"],
    "GenerationRequest.frequency_penalty": [SRV + "test_penalties_bias_and_masks_are_the_offline_ones"],
    "GenerationRequest.repetition_penalty": [SRV + "test_penalties_bias_and_masks_are_the_offline_ones"],
    "GenerationRequest.logit_bias": [SRV + "test_penalties_bias_and_masks_are_the_offline_ones"],
    "GenerationRequest.allowed_token_ids": [SRV + "test_penalties_bias_and_masks_are_the_offline_ones"],
    "GenerationRequest.bad_words": [SRV + "test_penalties_bias_and_masks_are_the_offline_ones"],
    "GenerationRequest.prompt_logprobs": [SRV + "test_prompt_logprobs_and_echo"],
    "GenerationRequest.return_token_ids": [SRV + "test_token_ids_in_answers_and_headers"],
    "GenerationRequest.cache_salt": [SRV + "test_request_conformance"],
    "GenerationRequest.truncate_prompt_tokens": [RF + "test_truncation_side_keeps_the_first_or_the_last_tokens"],
    "GenerationRequest.response_format": [SRV + "test_structured_outputs_whole_and_streamed"],
    "GenerationRequest.structured_outputs": [SRV + "test_structured_outputs_whole_and_streamed"],
    "GenerationRequest.truncation_side": [RF + "test_truncation_side_keeps_the_first_or_the_last_tokens"],
    "GenerationRequest.return_tokens_as_token_ids": [RF + "test_return_tokens_as_token_ids_per_request"],
    "GenerationRequest.use_beam_search": [RF + "test_use_beam_search_chat_answers_the_offline_beams",
                                          RF + "test_use_beam_search_completions",
                                          RF + "test_use_beam_search_refuses_what_it_cannot_honour"],
    "GenerationRequest.length_penalty": [RF + "test_use_beam_search_chat_answers_the_offline_beams",
                                         BEAM + "test_beam_search_equals_transformers"],
    "GenerationRequest.early_stopping": [RF + "test_use_beam_search_chat_answers_the_offline_beams",
                                         BEAM + "test_beam_search_equals_transformers"],
    "StreamOptions.include_usage": [SRV + "test_streaming_chat_equals_non_streaming"],
    "StreamOptions.continuous_usage_stats": [SRV + "test_request_conformance"],
    "ChatCompletionRequest.messages": [SRV + "test_chat_matches_offline_llm"],
    "ChatCompletionRequest.max_completion_tokens": [RF + "test_sampling_fields_change_the_answer"],
    "ChatCompletionRequest.tools": [SRV + "test_tool_calls_forced_streamed_and_round_tripped"],
    "ChatCompletionRequest.tool_choice": [SRV + "test_tool_calls_forced_streamed_and_round_tripped"],
    "ChatCompletionRequest.parallel_tool_calls": [SRV + "test_tool_calls_forced_streamed_and_round_tripped"],
    "ChatCompletionRequest.add_generation_prompt": [RF + "test_chat_echo_prepends_the_last_message_of_the_answers_role"],
    "ChatCompletionRequest.continue_final_message": [
        RF + "test_chat_echo_prepends_the_last_message_of_the_answers_role", SRV + "test_request_conformance"],
    "ChatCompletionRequest.echo": [RF + "test_chat_echo_prepends_the_last_message_of_the_answers_role"],
    "ChatCompletionRequest.chat_template_kwargs": [RF + "test_chat_template_kwargs_reach_the_template"],
    "ChatCompletionRequest.logprobs": [SRV + "test_chat_logprobs_are_the_offline_ones"],
    "ChatCompletionRequest.top_logprobs": [SRV + "test_chat_logprobs_are_the_offline_ones"],
    "CompletionRequest.prompt": [SRV + "test_text_completion_with_media_matches_offline"],
    "CompletionRequest.media": [SRV + "test_text_completion_with_media_matches_offline"],
    "CompletionRequest.echo": [SRV + "test_prompt_logprobs_and_echo"],
    "CompletionRequest.suffix": [SRV + "test_request_conformance"],
    "CompletionRequest.logprobs": [SRV + "test_completion_logprobs_legacy_shape"],
    "TokenizeRequest.model": [RF + "test_model_names_the_served_model"],
    "TokenizeRequest.prompt": [SRV + "test_tokenize_and_detokenize"],
    "TokenizeRequest.messages": [SRV + "test_tokenize_and_detokenize"],
    "TokenizeRequest.add_generation_prompt": [SRV + "test_request_conformance"],
    "TokenizeRequest.continue_final_message": [SRV + "test_request_conformance"],
    "TokenizeRequest.add_special_tokens": [RF + "test_tokenize_fields"],
    "TokenizeRequest.mm_processor_kwargs": [RF + "test_tokenize_fields"],
    "TokenizeRequest.return_token_strs": [CONF + "test_tokenize_token_strs_special_tokens_and_tools"],
    "TokenizeRequest.tools": [CONF + "test_tokenize_token_strs_special_tokens_and_tools"],
    "DetokenizeRequest.model": [RF + "test_model_names_the_served_model"],
    "DetokenizeRequest.tokens": [SRV + "test_tokenize_and_detokenize"],
    **{f"extra.{name}": UNSUPPORTED for name in protocol.UNSUPPORTED_FIELDS},
    **{f"extra.{name}": [RF + "test_guided_fields_constrain_the_output"] for name in protocol.GUIDED_FIELDS},
    **{f"extra.{name}": [RF + "test_identity_fields_change_no_answer"] for name in protocol.IDENTITY_FIELDS},
    "route.ChatCompletionRequest.add_special_tokens": ROUTE,
    "route.CompletionRequest.tools": ROUTE,
    "route.CompletionRequest.tool_choice": ROUTE,
    "route.CompletionRequest.parallel_tool_calls": ROUTE,
    "route.CompletionRequest.add_special_tokens": ROUTE,
}
# a parametrized test may name the table it walks instead of each field
TABLES = ("UNSUPPORTED_FIELDS", "GUIDED_FIELDS", "IDENTITY_FIELDS", "route_unsupported_fields")


def _models() -> dict[str, type[BaseModel]]:
    found = {}
    for info in pkgutil.iter_modules(openai_package.__path__):
        module = importlib.import_module(f"{openai_package.__name__}.{info.name}")
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__:
                found[name] = cls
    return found


def _request_fields() -> set[str]:
    fields = set()
    for name, cls in _models().items():
        if name in RESPONSE_MODELS:
            continue
        declared = cls.__dict__.get("__annotations__", {})
        fields |= {f"{name}.{field}" for field in cls.model_fields if field in declared}
        fields |= {f"route.{name}.{field}" for field in cls.__dict__.get("route_unsupported_fields", {})}
    for table in (protocol.UNSUPPORTED_FIELDS, protocol.GUIDED_FIELDS, protocol.IDENTITY_FIELDS):
        fields |= {f"extra.{name}" for name in table}
    return fields


def _test_source(node_id: str) -> str | None:
    path, _, name = node_id.partition("::")
    file = ROOT / path
    if not file.exists():
        return None
    text = file.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            decorators = "".join(ast.get_source_segment(text, d) or "" for d in node.decorator_list)
            return decorators + (ast.get_source_segment(text, node) or "")
    return None


def test_every_model_is_classified():
    unclassified = sorted(set(_models()) - RESPONSE_MODELS - BASE_MODELS - {k.split(".")[0] for k in FIELD_TESTS}
                          - {k.split(".")[1] for k in FIELD_TESTS if k.startswith("route.")})
    assert not unclassified, (f"{unclassified}: add each to RESPONSE_MODELS, or map its fields in FIELD_TESTS")
    assert not RESPONSE_MODELS - set(_models()), f"RESPONSE_MODELS names models that are gone: {RESPONSE_MODELS - set(_models())}"


def test_every_request_field_has_a_test_and_every_entry_a_field():
    fields = _request_fields()
    assert not sorted(fields - set(FIELD_TESTS)), f"fields no test exercises: {sorted(fields - set(FIELD_TESTS))}"
    assert not sorted(set(FIELD_TESTS) - fields), f"entries for fields that are gone: {sorted(set(FIELD_TESTS) - fields)}"


def test_every_named_test_exists_and_names_its_field():
    problems = []
    for key, node_ids in FIELD_TESTS.items():
        field = key.rsplit(".", 1)[1]
        assert node_ids, key
        for node_id in node_ids:
            source = _test_source(node_id)
            if source is None:
                problems.append(f"{key}: no test {node_id}")
            elif field not in source and not any(table in source for table in TABLES):
                problems.append(f"{key}: {node_id} never names {field!r}")
    assert not problems, "\n".join(problems)


def test_the_walk_sees_a_new_field(monkeypatch):
    """A field added to a request model, or to one of the undeclared-field tables, is missing from
    FIELD_TESTS until a test is named for it (the walk fails honestly)."""
    from mmserve.entrypoints.openai import chat

    class ProbeRequest(chat.ChatCompletionRequest):
        brand_new_knob: int = 0

    ProbeRequest.__module__ = chat.__name__
    monkeypatch.setattr(chat, "ProbeRequest", ProbeRequest, raising=False)
    monkeypatch.setattr(protocol, "IDENTITY_FIELDS", (*protocol.IDENTITY_FIELDS, "brand_new_id"))
    missing = _request_fields() - set(FIELD_TESTS)
    assert missing == {"ProbeRequest.brand_new_knob", "extra.brand_new_id"}
