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
    # Anthropic's Messages API (anthropic_protocol.py, anthropic_stream.py)
    "AnthropicErrorInfo", "AnthropicErrorResponse", "AnthropicMessage", "AnthropicUsage", "BlockDelta", "BlockStart",
    "BlockStop", "CountTokensResponse", "InputJsonDelta", "MessageDelta", "MessageStart", "MessageStop", "Ping",
    "StopDelta", "TextBlock", "TextDelta", "ThinkingBlock", "ThinkingDelta", "ToolUseBlock",
    # OpenAI's Responses API (responses_protocol.py, responses_stream.py)
    "FunctionCallItem", "IncompleteDetails", "InputTokensDetails", "OutputMessage", "OutputText",
    "OutputTokensDetails", "ReasoningItem", "ReasoningText", "ResponseError", "ResponseObject", "ResponseUsage",
    "StreamEvent",
    # the pooling routes (pooling_protocol.py)
    "EmbeddingData", "EmbeddingResponse", "ListResponse", "PoolingUsage", "RerankDocument", "RerankResponse", "RerankResult",
    "ScoreData", "ScoreResponse",
}
BASE_MODELS = {"NullMeansUnset", "WireModel", "Strict"}  # bases that declare no field of their own
RF = "tests/models/test_request_fields.py::"
SRV = "tests/e2e/test_server.py::"
BEAM = "tests/models/test_beam_search.py::"
CONF = "tests/models/test_server_conformance.py::"
AM = "tests/models/test_anthropic_messages.py::"
RA = "tests/models/test_responses_api.py::"
AC = "tests/e2e/test_api_clients_anthropic.py::"
RC = "tests/e2e/test_api_clients_responses.py::"
PO = "tests/models/test_pooling_api.py::"
UNSUPPORTED = [RF + "test_unsupported_fields_are_refused_unless_neutral"]
ROUTE = [RF + "test_route_unsupported_fields"]
# "Model.field" (the model that declares it) or "extra.field" (taken undeclared) -> the tests that exercise it
FIELD_TESTS: dict[str, list[str]] = {
    "PoolingRequestBase.model": [PO + "test_malformed_bodies_are_400s_naming_the_field"],
    "PoolingRequestBase.user": [PO + "test_embeddings_in_every_input_form_equal_the_offline_ones"],
    "PoolingRequestBase.truncate_prompt_tokens": [PO + "test_dimensions_activation_and_truncation"],
    "PoolingRequestBase.use_activation": [PO + "test_dimensions_activation_and_truncation",
                                          PO + "test_a_reranker_scores_pairs_through_its_score_template"],
    "PoolingRequestBase.mm_processor_kwargs": [PO + "test_messages_with_an_image_embed_as_the_rendered_chat"],
    "EmbeddingRequest.input": [PO + "test_embeddings_in_every_input_form_equal_the_offline_ones"],
    "EmbeddingRequest.messages": [PO + "test_messages_with_an_image_embed_as_the_rendered_chat"],
    "EmbeddingRequest.encoding_format": [PO + "test_embeddings_in_every_input_form_equal_the_offline_ones"],
    "EmbeddingRequest.dimensions": [PO + "test_dimensions_activation_and_truncation"],
    "EmbeddingRequest.normalize": [PO + "test_dimensions_activation_and_truncation"],
    "EmbeddingRequest.add_generation_prompt": [PO + "test_messages_with_an_image_embed_as_the_rendered_chat"],
    "EmbeddingRequest.continue_final_message": [PO + "test_messages_with_an_image_embed_as_the_rendered_chat"],
    "EmbeddingRequest.chat_template_kwargs": [PO + "test_messages_with_an_image_embed_as_the_rendered_chat"],
    "ScoreRequest.data_1": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "ScoreRequest.data_2": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "ScoreRequest.text_1": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "ScoreRequest.text_2": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "ScoreRequest.queries": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "ScoreRequest.documents": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "RerankRequest.query": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "RerankRequest.documents": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "RerankRequest.top_n": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
    "RerankRequest.return_documents": [PO + "test_score_and_rerank_spellings_agree_with_the_offline_cosine"],
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
    # the Messages and Responses APIs' fields (the tests that send or refuse each)
    "Base64ImageSource.type": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused', AC + 'test_the_sdks_typed_errors'],
    "Base64ImageSource.media_type": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused', AC + 'test_the_sdks_typed_errors'],
    "Base64ImageSource.data": [AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says', AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "CacheControl.type": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "CacheControl.ttl": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "CountTokensRequest.model": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_a_stream_comes_in_anthropics_order_and_joins_to_the_whole_answer'],
    "CountTokensRequest.messages": [AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says', AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "CountTokensRequest.system": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "CountTokensRequest.tools": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "CountTokensRequest.tool_choice": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "CountTokensRequest.thinking": [AM + 'test_a_template_that_does_not_think_answers_without_a_thinking_block', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ImageBlockParam.type": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused', AC + 'test_a_picture_by_url'],
    "ImageBlockParam.source": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused', AC + 'test_a_picture_by_url'],
    "ImageBlockParam.cache_control": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "MessageParam.role": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "MessageParam.content": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "MessagesRequest.max_tokens": [AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says', AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "MessagesRequest.temperature": [AM + 'test_a_stream_comes_in_anthropics_order_and_joins_to_the_whole_answer', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "MessagesRequest.top_p": [AM + 'test_top_k_and_top_p_reach_the_sampler'],
    "MessagesRequest.top_k": [AM + 'test_top_k_and_top_p_reach_the_sampler'],
    "MessagesRequest.stop_sequences": [AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says', AM + 'test_a_stream_comes_in_anthropics_order_and_joins_to_the_whole_answer'],
    "MessagesRequest.stream": [AM + 'test_a_stream_comes_in_anthropics_order_and_joins_to_the_whole_answer', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "MessagesRequest.metadata": [AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "Metadata.user_id": [AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "ResponsesRequest.model": [RA + 'test_unknown_ids_and_models_are_404s_and_the_server_answers_after', RA + 'test_a_request_the_engine_fails_midway_ends_its_stream_with_response_failed'],
    "ResponsesRequest.input": [RA + 'test_previous_response_id_continues_as_the_whole_history_would', RA + 'test_a_chain_deeper_than_the_store_allows_is_refused'],
    "ResponsesRequest.instructions": [RA + 'test_previous_response_id_continues_as_the_whole_history_would', RC + 'test_an_openai_agents_agent_runs_against_the_server'],
    "ResponsesRequest.max_output_tokens": [RA + 'test_a_conversation_is_chats_prompt_and_greedy_answer', RA + 'test_previous_response_id_continues_as_the_whole_history_would'],
    "ResponsesRequest.temperature": [RA + 'test_a_request_the_engine_fails_midway_ends_its_stream_with_response_failed', RA + 'test_top_p_reaches_the_sampler'],
    "ResponsesRequest.top_p": [RA + 'test_top_p_reaches_the_sampler'],
    "ResponsesRequest.tools": [RA + 'test_previous_response_id_continues_as_the_whole_history_would', RA + 'test_a_forced_tool_choice_answers_with_function_call_items'],
    "ResponsesRequest.tool_choice": [RA + 'test_previous_response_id_continues_as_the_whole_history_would', RA + 'test_a_forced_tool_choice_answers_with_function_call_items'],
    "ResponsesRequest.parallel_tool_calls": [RA + 'test_a_forced_tool_choice_answers_with_function_call_items'],
    "ResponsesRequest.text": [RA + 'test_text_format_constrains_the_output_and_is_echoed', RA + 'test_a_stream_is_the_response_as_events'],
    "ResponsesRequest.reasoning": [RA + 'test_a_thought_is_a_reasoning_item'],
    "ResponsesRequest.store": [RA + 'test_max_output_tokens_makes_an_incomplete_response'],
    "ResponsesRequest.previous_response_id": [RA + 'test_previous_response_id_continues_as_the_whole_history_would', RA + 'test_a_chain_deeper_than_the_store_allows_is_refused'],
    "ResponsesRequest.metadata": [RA + 'test_max_output_tokens_makes_an_incomplete_response'],
    "ResponsesRequest.stream": [RA + 'test_stored_responses_are_retrieved_listed_and_deleted'],
    "ResponsesRequest.user": [RA + 'test_previous_response_id_continues_as_the_whole_history_would', RA + 'test_text_format_constrains_the_output_and_is_echoed'],
    "ResponsesRequest.safety_identifier": [RA + 'test_max_output_tokens_makes_an_incomplete_response'],
    "ResponsesRequest.prompt_cache_key": [RA + 'test_max_output_tokens_makes_an_incomplete_response'],
    "TextBlockParam.type": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "TextBlockParam.text": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "TextBlockParam.cache_control": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "TextBlockParam.citations": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "ThinkingAdaptive.type": [AM + 'test_a_template_that_does_not_think_answers_without_a_thinking_block'],
    "ThinkingBlockParam.type": [AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ThinkingBlockParam.thinking": [AM + 'test_a_template_that_does_not_think_answers_without_a_thinking_block', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ThinkingBlockParam.signature": [AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ThinkingDisabled.type": [AM + 'test_a_template_that_does_not_think_answers_without_a_thinking_block', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ThinkingEnabled.type": [AM + 'test_a_template_that_does_not_think_answers_without_a_thinking_block', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ThinkingEnabled.budget_tokens": [AM + 'test_a_template_that_does_not_think_answers_without_a_thinking_block', AM + 'test_thinking_is_a_thinking_block_and_none_when_disabled'],
    "ToolChoiceAny.type": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_a_tools_description_reaches_the_template_and_strict_or_not_a_forced_input_fits_its_schema'],
    "ToolChoiceAny.disable_parallel_tool_use": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolChoiceAuto.type": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "ToolChoiceAuto.disable_parallel_tool_use": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolChoiceNone.type": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolChoiceTool.type": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "ToolChoiceTool.name": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolChoiceTool.disable_parallel_tool_use": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolParam.name": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolParam.input_schema": [AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "ToolParam.description": [AM + 'test_a_tools_description_reaches_the_template_and_strict_or_not_a_forced_input_fits_its_schema'],
    "ToolParam.type": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "ToolParam.strict": [AM + 'test_a_tools_description_reaches_the_template_and_strict_or_not_a_forced_input_fits_its_schema'],
    "ToolParam.cache_control": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "ToolResultBlockParam.type": [AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input', AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "ToolResultBlockParam.tool_use_id": [AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input', AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "ToolResultBlockParam.content": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_stop_sequences_and_max_tokens_end_as_anthropic_says'],
    "ToolResultBlockParam.is_error": [AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "ToolResultBlockParam.cache_control": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "ToolUseBlockParam.type": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "ToolUseBlockParam.id": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_a_stream_comes_in_anthropics_order_and_joins_to_the_whole_answer'],
    "ToolUseBlockParam.name": [AM + 'test_a_conversation_is_chats_prompt_and_greedy_answer', AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema'],
    "ToolUseBlockParam.input": [AM + 'test_tool_choices_make_tool_use_blocks_held_to_the_schema', AM + 'test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input'],
    "ToolUseBlockParam.cache_control": [AM + 'test_cache_control_breakpoints_change_nothing_and_citations_are_refused'],
    "UrlImageSource.type": [AC + 'test_a_picture_by_url'],
    "UrlImageSource.url": [AC + 'test_a_picture_by_url', AC + 'test_the_sdks_typed_errors'],
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
