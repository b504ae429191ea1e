"""The server's answers in the shapes vLLM gives them, on the bundled demo model in process (the app over
an AsyncEngine, FastAPI's TestClient): `null` for every field with a default; forced tool calls held to the
tool's schema whatever `strict` says; streams as vLLM sends them; an echoed prompt token among its top
logprobs; custom roles rendered; /tokenize's `token_strs`, `add_special_tokens` and `tools`; error messages
that name the vocabulary size and every bad key."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mmserve import LLM
from mmserve.demo.eval import default_model_dir
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.chat import ChatCompletionRequest
from mmserve.entrypoints.openai.completions import CompletionRequest
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.protocol import GUIDED_FIELDS, UNSUPPORTED_FIELDS
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig

MESSAGES = [{"role": "user", "content": "Is the circle red?"}]
COUNT_TOOL = {"type": "function", "function": {"name": "count_shapes", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "big": {"type": "boolean"}},
    "required": ["color", "big"], "additionalProperties": False}}}  # no `strict`: instructor's, LangChain's
AREA_TOOL = {"type": "function", "function": {"name": "area", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_dir()), num_kv_blocks=256)


@pytest.fixture(scope="module")
def client(llm):
    app = build_app(AsyncEngine(llm.engine), ServerConfig("demo", MediaRules(llm.engine.config.media)))
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def random_client(checkpoint_dirs):
    """A tiny random Qwen2-VL: its byte-piece tokens decode alike (to U+FFFD), which the echo test needs."""
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), num_kv_blocks=64)
    app = build_app(AsyncEngine(llm.engine), ServerConfig("demo", MediaRules(llm.engine.config.media)))
    with TestClient(app) as test_client:
        yield test_client


def events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- null means unset ---------------------------------------------------------------------------------
# request fields that are no model field but that OpenAI or vLLM documents, sent by clients
EXTRA_NULLABLE = ("user", "service_tier", "store", "metadata", *UNSUPPORTED_FIELDS, *GUIDED_FIELDS)


@pytest.mark.parametrize("route, model, base", [
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": MESSAGES}),
    ("/v1/completions", CompletionRequest, {"prompt": "Is the circle red?"}),
])
def test_null_is_the_default_for_every_field_that_has_one(client, route, model, base):
    """Each field of the request model with a default (and the documented extra fields), sent as null,
    answers as if it were left out: the same text under the same seed; a required field's null is a 400
    naming it."""
    base = {"model": "demo", **base, "max_tokens": 3, "seed": 7}

    def answer(body: dict) -> tuple[str, int]:
        reply = client.post(route, json=body)
        assert reply.status_code == 200, (body, reply.text)
        choice = reply.json()["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content")), len(reply.json()["choices"])

    expected = answer(base)
    nullable = [name for name, f in model.model_fields.items() if not f.is_required()] + list(EXTRA_NULLABLE)
    assert {"n", "stream", "min_tokens", "ignore_eos", "skip_special_tokens", "temperature", "stop", "logit_bias",
            "response_format", "stream_options", "user"} <= set(nullable)
    for name in nullable:
        body = {**base, name: None}
        if name in ("max_tokens", "seed"):  # their default is another answer: only refused or not
            client.post(route, json={**body, "max_tokens": 3} if name == "seed" else body).raise_for_status()
            continue
        assert answer(body) == expected, name
    assert answer({**base, **{name: None for name in nullable if name not in ("max_tokens", "seed")}}) == expected
    for name, f in model.model_fields.items():
        if f.is_required():
            refused = client.post(route, json={**base, name: None})
            assert refused.status_code == 400 and refused.json()["error"]["param"].split(".")[0] == name, refused.text


# ---- tools ---------------------------------------------------------------------------------------------
def test_forced_tool_calls_follow_the_schema_without_strict(client):
    """A named or required tool choice on a tool without `strict` (or with `strict` inside its parameters)
    gives arguments that match the schema, not `{}`; content is "" (vLLM's); a named choice finishes with
    stop, required with tool_calls; without a call the message has no `tool_calls` at all."""
    import jsonschema

    schema = COUNT_TOOL["function"]["parameters"]
    slipped = {"type": "function", "function": {"name": "count_shapes", "parameters": {**schema, "strict": True}}}
    named = {"type": "function", "function": {"name": "count_shapes"}}
    for tools, choice, finish in (([COUNT_TOOL, AREA_TOOL], named, "stop"), ([slipped], named, "stop"),
                                  ([COUNT_TOOL], "required", "tool_calls")):
        reply = client.post("/v1/chat/completions", json={
            "model": "demo", "messages": MESSAGES, "tools": tools, "tool_choice": choice, "max_tokens": 150,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        answer = reply.json()["choices"][0]
        assert answer["finish_reason"] == finish and answer["message"]["content"] == "", answer
        (call,) = answer["message"]["tool_calls"]
        assert call["function"]["name"] == "count_shapes"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    for extra in ({"tools": [COUNT_TOOL], "tool_choice": "none"}, {}):
        plain = client.post("/v1/chat/completions", json={"model": "demo", "messages": MESSAGES, "max_tokens": 3,
                                                          **extra}).json()["choices"][0]["message"]
        assert "tool_calls" not in plain and isinstance(plain["content"], str)
    chunks = events(client.post("/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "tools": [COUNT_TOOL], "tool_choice": named, "max_tokens": 150,
        "temperature": 0, "stream": True}))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"] and deltas[0]["type"] == "function" and deltas[0]["function"]["name"] == "count_shapes"
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d["function"]["arguments"] for d in deltas)), schema)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- streams -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route, body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                         ("/v1/completions", {"prompt": "Is the circle red?"})])
def test_streams_as_vllm_sends_them(client, route, body):
    """The last text and the finish reason share a chunk; continuous usage only with include_usage, the
    role chunk counting no token and each later chunk its choice's tokens so far; the prompt's ids only in
    the first chunk."""
    body = {"model": "demo", **body, "max_tokens": 4, "min_tokens": 4, "temperature": 0, "stream": True}
    whole = client.post(route, json={**body, "stream": False}).json()
    for options in ({"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": True}):
        chunks = events(client.post(route, json={**body, "stream_options": options}))
        if "include_usage" not in options:
            assert all("usage" not in c or c["usage"] is None for c in chunks), chunks
            continue
        counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert counted == ([0, 1, 2, 3, 4] if route.endswith("chat/completions") else [1, 2, 3, 4]), chunks
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        last = [c for c in chunks if c["choices"]][-1]["choices"][0]
        assert last["finish_reason"] == "length"
        text = last["delta"]["content"] if "delta" in last else last["text"]
        assert text and whole["choices"][0].get("text", (whole["choices"][0].get("message") or {}).get("content",
                                                                                                       "")).endswith(text)
    chunks = events(client.post(route, json={**body, "return_token_ids": True}))
    assert "prompt_token_ids" in json.dumps(chunks[0])
    if route.endswith("chat/completions"):
        assert all("prompt_token_ids" not in c for c in chunks[1:])


# ---- echo ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["The sky is blue and the grass is green", [0, 0, 0, 0, 0]])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_an_echoed_prompt_token_is_among_its_top_logprobs(client, random_client, prompt, k):
    """vLLM's echo test: every position's top logprobs hold its token with that token's own logprob, also
    where another of the k decodes to the same text (the random model's byte pieces, as token id 0)."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": k}
    for server in (client, random_client):
        whole = server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        streamed = events(server.post("/v1/completions", json={**body, "stream": True}))
        for logprobs in (whole, *(c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"])):
            for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
                if top is not None:  # the prompt's first token has none
                    # (tokens of the same text share a key: k + 1 at most)
                    assert top[token] == logprob and 1 <= len(top) <= k + 1, (token, top)


# ---- custom roles --------------------------------------------------------------------------------------
def test_custom_roles_reach_the_chat_template(client, llm):
    """vLLM and transformers pass any role to the template (this one renders it as `<|im_start|>narrator`)."""
    messages = [{"role": "narrator", "content": "A red circle sits on a blue square."}, *MESSAGES]
    rendered = llm.engine.processor.render_chat(messages).prompt
    assert "<|im_start|>narrator\nA red circle" in rendered
    tokenized = client.post("/tokenize", json={"model": "demo", "messages": messages}).json()
    assert tokenized["tokens"] == list(llm.engine.process_chat(messages).prompt_token_ids)
    reply = client.post("/v1/chat/completions", json={"model": "demo", "messages": messages, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == tokenized["count"], reply.text


# ---- /tokenize and /detokenize -------------------------------------------------------------------------
def test_tokenize_token_strs_special_tokens_and_tools(client, llm):
    tokenizer = llm.engine.processor.tokenizer
    plain = client.post("/tokenize", json={"prompt": "Is the circle red?", "return_token_strs": True}).json()
    assert plain["token_strs"] == [tokenizer.id_to_token(t) for t in plain["tokens"]]
    assert client.post("/tokenize", json={"prompt": "Is the circle red?"}).json()["token_strs"] is None
    # mmserve adds no special token to a prompt: false is what every route runs
    unspecial = client.post("/tokenize", json={"prompt": "Is the circle red?", "add_special_tokens": False})
    assert unspecial.status_code == 200 and unspecial.json()["tokens"] == plain["tokens"]
    chat = client.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": False}).json()
    assert chat["tokens"] == list(llm.engine.process_chat(MESSAGES).prompt_token_ids)
    with_tools = client.post("/tokenize", json={"messages": MESSAGES, "tools": [COUNT_TOOL],
                                                "return_token_strs": True}).json()
    expected = llm.engine.process_chat(MESSAGES, tools=[COUNT_TOOL]).prompt_token_ids
    assert with_tools["tokens"] == list(expected) and with_tools["count"] > chat["count"]
    assert "count_shapes" in tokenizer.decode(with_tools["tokens"], skip_special_tokens=False)
    assert len(with_tools["token_strs"]) == with_tools["count"]
    reply = client.post("/v1/chat/completions", json={"model": "demo", "messages": MESSAGES, "tools": [COUNT_TOOL],
                                                      "max_tokens": 1})
    assert reply.json()["usage"]["prompt_tokens"] == with_tools["count"]
    for bad, param in (({"prompt": "hi", "tools": [COUNT_TOOL]}, "tools"),
                       ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
                       ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens")):
        refused = client.post("/tokenize", json=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    back = client.post("/detokenize", json={"model": "demo", "tokens": chat["tokens"], "extra": None})
    assert back.status_code == 400  # an unknown field is refused, not ignored
    back = client.post("/detokenize", json={"model": None, "tokens": chat["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(chat["tokens"], skip_special_tokens=False)}


# ---- error messages ------------------------------------------------------------------------------------
def test_errors_name_the_vocabulary_size_and_every_bad_key(client, llm):
    vocab = llm.engine.spec.vocab_size
    cases = [
        ("/detokenize", {"tokens": [1, 99999, 2]}, "tokens", f"token id 99999 is out of vocabulary (size {vocab})"),
        ("/v1/completions", {"prompt": [1, 99999, 100000], "max_tokens": 1}, "prompt",
         f"token ids 99999, 100000 are out of vocabulary (size {vocab})"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {"99999": 1, "3": 1, "100000": -1}},
         "logit_bias", f"token ids 99999, 100000 are out of vocabulary (size {vocab})"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "logit_bias": {"a": 1, "3": 1, "b": 1}},
         "logit_bias", "logit_bias keys must be token ids, got 'a', 'b'"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "logit_bias": {"3": 300, "4": -200}},
         "logit_bias", "got 300.0 for token 3, -200.0 for token 4"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "stop_token_ids": [vocab, 5]},
         "stop_token_ids", f"token id {vocab} is out of vocabulary (size {vocab})"),
    ]
    for route, body, param, message in cases:
        refused = client.post(route, json={"model": "demo", **body})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == param and message in error["message"], error
