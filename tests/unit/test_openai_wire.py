"""The OpenAI wire format as vLLM answers it, without an engine: a thought under `reasoning` and
`reasoning_content` alike, whole and streamed; the finish reason on the chunk with the last text; usage so
far counted per choice (the role chunk none) and only with `include_usage`; null fields left out of stream
chunks; `null` meaning the default in every request field that has one; an echoed token among its own top
logprobs; error messages that name every bad logit_bias key and the vocabulary size."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mmserve import InvalidInputError, SamplingParams
from mmserve.entrypoints.openai.chat import ChatCompletionRequest, ChatServing
from mmserve.entrypoints.openai.completions import CompletionRequest
from mmserve.entrypoints.openai.logprobs import completion_logprobs
from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.streaming import StreamCursor
from mmserve.errors import out_of_vocabulary
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput

PROMPT_IDS = [1, 2, 3]


def outputs_of(pieces: list[str], finish_reason: str = "length") -> list[RequestOutput]:
    """One engine output per token of a single choice, the last finished."""
    outs, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        completion = CompletionOutput(0, text, list(range(10, 11 + i)), finish_reason if last else None)
        outs.append(RequestOutput("r", None, PROMPT_IDS, [completion], last, delta_text=piece))
    return outs


def stream(pieces: list[str], include_usage: bool = False, continuous: bool = False,
           in_thought: bool | None = None, finish_reason: str = "length") -> list[dict]:
    cursor = StreamCursor(None, continuous_usage=continuous, in_thought=in_thought)
    return [json.loads(chunk.model_dump_json()) for out in outputs_of(pieces, finish_reason)
            for chunk in ChatServing._chunks("r", "m", include_usage, cursor, out)]


def test_the_finish_reason_rides_on_the_chunk_with_the_last_text():
    chunks = stream(["One", ",", " two"])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert deltas == [{"content": "One"}, {"content": ","}, {"content": " two"}]  # no empty finish chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    for chunk in chunks:  # nothing vLLM leaves out is sent as null
        assert "usage" not in chunk and "prompt_token_ids" not in chunk and "token_ids" not in chunk["choices"][0]


def test_a_choice_that_ends_on_no_text_still_sends_its_finish_reason():
    chunks = stream(["Hi", ""], finish_reason="stop")  # the end-of-text token decodes to nothing
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}


@pytest.mark.parametrize("include_usage, continuous", [(False, False), (False, True), (True, False), (True, True)])
def test_usage_is_sent_as_vllm_decides(include_usage, continuous):
    asked = ChatCompletionRequest(messages=[], stream=True, stream_options={"include_usage": include_usage,
                                                                           "continuous_usage_stats": continuous})
    chunks = stream(["a", "b", "c"], *asked.stream_usage())
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and "usage" in c]
    # continuous usage only with include_usage; the role chunk counts no token, then each chunk its choice's
    assert counted == ([0, 1, 2, 3] if include_usage and continuous else [])
    final = [c for c in chunks if not c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in final] == ([3] if include_usage else [])
    force = ChatCompletionRequest(messages=[], stream=True).stream_usage(force=True)
    assert force == (True, False)  # the server's --enable-force-include-usage: a usage chunk, asked or not


def test_a_thought_is_reasoning_and_reasoning_content_whole_and_streamed():
    completion = CompletionOutput(0, "Look closely.\n</think>\n\nA red circle.", [5, 6], "stop")
    message, finish = ChatServing.message_of(completion, None, in_thought=True)
    body = message.model_dump()
    assert body["reasoning"] == body["reasoning_content"] == "Look closely." and body["content"] == "A red circle."
    assert "tool_calls" not in body and finish == "stop"
    plain = ChatServing.message_of(CompletionOutput(0, "Hi.", [5], "stop"), None)[0].model_dump()
    assert plain["reasoning"] is None and plain["reasoning_content"] is None and "tool_calls" not in plain
    chunks = stream(["Look", " closely.", "\n</think>\n\n", "A red", " circle."], in_thought=True)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    thought = "".join(d.get("reasoning", "") for d in deltas)
    assert thought == "".join(d.get("reasoning_content", "") for d in deltas) == "Look closely."
    assert "".join(d.get("content", "") for d in deltas) == "A red circle."
    assert all("content" not in d for d in deltas if "reasoning" in d)  # a thought's chunk carries no content


def test_null_means_the_default_in_every_request_field_that_has_one():
    """Every defaulted field of both request bodies, sent as null, parses to the field's default; a required
    field's null stays an error naming it."""
    required = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    for model in (ChatCompletionRequest, CompletionRequest):
        needed = {k: required[k] for k, f in model.model_fields.items() if f.is_required()}
        defaults = model(**needed)
        for name, field in model.model_fields.items():
            if field.is_required():
                with pytest.raises(ValidationError, match=name):
                    model(**{**needed, name: None})
                continue
            assert getattr(model(**needed, **{name: None}), name) == getattr(defaults, name), name
    options = ChatCompletionRequest(**required, stream=True, stream_options={"include_usage": None,
                                                                          "continuous_usage_stats": None})
    assert options.stream_usage() == (False, False)
    # nested nulls too: a json_schema format's schema and strict, structured_outputs' keys
    nested = ChatCompletionRequest(**required, response_format={"type": "json_schema", "json_schema": {
        "name": "any", "schema": None, "strict": None, "description": None}})
    assert json.loads(nested.structured()[0].json) == {"type": "object"}
    keys = CompletionRequest(prompt="hi", structured_outputs={"regex": "[ab]", "json": None, "choice": None,
                                                              "disable_any_whitespace": None})
    assert keys.structured()[0].regex == "[ab]"


def test_the_openapi_schema_says_every_defaulted_field_takes_null():
    """The request schemas (what FastAPI puts in /openapi.json) agree with what the server accepts: a
    schema-checking client may send null for every field with a default, and for no required one."""
    from mmserve.entrypoints.openai.tokens import DetokenizeRequest, TokenizeRequest

    def takes_null(prop: dict) -> bool:
        return prop.get("type") == "null" or any(takes_null(p) for p in prop.get("anyOf", ()))

    for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest):
        properties = model.model_json_schema(mode="validation")["properties"]
        for name, field in model.model_fields.items():
            assert takes_null(properties[name]) != field.is_required(), (model.__name__, name)


def test_an_echoed_token_is_among_its_own_top_logprobs():
    """Even where one of the k most likely tokens decodes to the same text (a byte piece, a prompt token
    echoed), the position's top logprobs hold the token with its own logprob."""
    entry = {7: Logprob(-5.0, rank=9, decoded_token="\ufffd"), 8: Logprob(-0.1, rank=1, decoded_token="\ufffd"),
             9: Logprob(-2.0, rank=2, decoded_token="x")}
    out = completion_logprobs([7], [entry], 2)
    assert out.tokens == ["\ufffd"] and out.token_logprobs == [-5.0]
    assert out.top_logprobs[0]["\ufffd"] == -5.0 and out.top_logprobs[0]["x"] == -2.0


def test_errors_name_every_bad_logit_bias_key_and_the_vocabulary_size():
    body = ChatCompletionRequest(messages=[], logit_bias={"five": 1, "7": 1, "six": 2})
    with pytest.raises(RequestError, match="logit_bias keys must be token ids, got 'five', 'six'"):
        body.sampling_params(100, 1)
    with pytest.raises(InvalidInputError, match="got -1, -4") as raised:
        SamplingParams(logit_bias={-1: 1.0, 3: 1.0, -4: 1.0})
    assert raised.value.param == "logit_bias"
    with pytest.raises(InvalidInputError, match="got 200 for token 3, -300 for token 5"):
        SamplingParams(logit_bias={3: 200, 4: 1.0, 5: -300})
    assert out_of_vocabulary([99999], 1024) == "token id 99999 is out of vocabulary (size 1024)"
    assert out_of_vocabulary([5, 2000, -1, 2000], 1024) == "token ids 2000, -1 are out of vocabulary (size 1024)"
    assert out_of_vocabulary(range(2000, 2030), 1024, shown=2) == (
        "token ids 2000, 2001 and 28 more are out of vocabulary (size 1024)")
    assert out_of_vocabulary([0, 1023], 1024) is None
